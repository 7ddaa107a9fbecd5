"""Kiln's CPU kernels (runtime/kernels/*.c: matmuls of int8 and int4 blocks and of fp32, attention, SwiGLU),
built into a shared library that ONNX Runtime loads as a custom-op library (runtime/cpu_kernels.py).
Everything else about the package is in pyproject.toml.

The build is optional: a host without a C compiler, or with a CPU other than x86-64, installs Kiln
without it, and the runtime runs each variant's standard graph (model.onnx) instead."""

import platform

from setuptools import Extension, setup

X86 = platform.machine().lower() in ("x86_64", "amd64")
# -ffp-contract=off: a multiply and the add after it round twice, as written (GCC's default would fuse
# them, Clang's may): the attention kernel reproduces ONNX Runtime's roundings (int8_blocks.c compiles to
# the same code either way).
FLAGS = ["-O3", "-pthread", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-ffp-contract=off"]

SOURCES = [f"runtime/kernels/{name}.c" for name in ("library", "int8_blocks", "attention", "swiglu", "matmul_fp32")]

HEADERS = [f"runtime/kernels/{name}.h" for name in ("ort_api", "silu")]

setup(ext_modules=[Extension("runtime._cpu_kernels", SOURCES, depends=HEADERS, extra_compile_args=FLAGS,
                             extra_link_args=["-pthread"], optional=True)] if X86 else [])
