"""Kiln's CPU kernels (runtime/kernels/int8_blocks.c, swiglu.c, matmul_fp32.c) in a real ONNX Runtime session, against
MLAS's MatMulNBits on the same weights and ONNX Runtime's own nodes on the same inputs; skipped where this
machine cannot run them."""

from __future__ import annotations

import ctypes
import os

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from runtime import cpu_kernels
from tests.conftest import as_bf16

LIBRARY, WHY_NOT = cpu_kernels.library()
needs_kernels = pytest.mark.skipif(LIBRARY is None, reason=f"Kiln's CPU kernels: {WHY_NOT}")


def session(op: str, codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None) -> ort.InferenceSession:
    """One MatMulNBits over these weights, or one MatMulInt8Blocks over them packed for it."""
    n, blocks, _ = codes.shape
    k = blocks * 32
    if op == "MatMulNBits":
        inputs = ["A", "B", "S"] + (["Z"] if zero_points is not None else [])
        node = helper.make_node(op, inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=8, block_size=32,
                                accuracy_level=4)
        weights = [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(scales, "S")]
        if zero_points is not None:
            weights.append(numpy_helper.from_array(zero_points, "Z"))
    else:
        node = helper.make_node(cpu_kernels.INT8_BLOCKS_OP, ["A", "W"], ["Y"], domain=cpu_kernels.DOMAIN, K=k, N=n)
        weights = [numpy_helper.from_array(cpu_kernels.pack_int8_blocks(codes, scales, zero_points), "W")]
    return one_node_session(node, weights, k, n)


def one_node_session(node, weights: list, k: int | str, n: int, threads: int = 2) -> ort.InferenceSession:
    """A session of `node` alone, A [b, s, K] -> Y [b, s, N], on `threads` threads, Kiln's library
    registered for its ops."""
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["b", "s", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["b", "s", n])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(node.domain, 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if node.domain == cpu_kernels.DOMAIN:
        options.register_custom_ops_library(str(LIBRARY))
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


@needs_kernels
@pytest.mark.parametrize("k, n", [(64, 40), (576, 960), (1536, 70)])  # 40 and 70: a part-filled tile of 16
@pytest.mark.parametrize("with_zero_points", [True, False])
def test_the_kernel_computes_what_matmulnbits_does_and_each_row_alone_the_same(k, n, with_zero_points):
    rng = np.random.default_rng(k + n)
    codes = rng.integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
    scales = (rng.random(n * (k // 32)) * 0.01 + 0.001).astype(np.float32)
    zero_points = rng.integers(100, 156, n * (k // 32), dtype=np.uint8) if with_zero_points else None
    mlas = session("MatMulNBits", codes, scales, zero_points)
    kiln = session("kiln", codes, scales, zero_points)
    for rows in (1, 3, 9, 70, 130):  # one row; the 8-row groups; the 64-row chunks
        x = rng.standard_normal((1, rows, k)).astype(np.float32)
        x[0, 0, :32] = 0  # an all-zero block: scale 0, not a division by it
        expected, got = mlas.run(None, {"A": x})[0], kiln.run(None, {"A": x})[0]
        assert got.shape == expected.shape == (1, rows, n)
        # The same int8 codes on both sides, so only the order of the fp32 sums differs (one activation
        # code apart would show as about 1e-3).
        assert np.abs(got - expected).max() <= 2e-6 * np.abs(expected).max()
        alone = np.concatenate([kiln.run(None, {"A": x[:, i:i + 1]})[0] for i in range(rows)], axis=1)
        assert np.array_equal(alone, got)


@needs_kernels
@pytest.mark.parametrize("fed", ["at run time", "of the wrong size"])
def test_weights_not_packed_in_the_graph_are_refused_in_one_line(fed):
    node = helper.make_node(cpu_kernels.INT8_BLOCKS_OP, ["A", "W"], ["Y"], domain=cpu_kernels.DOMAIN, K=32, N=16)
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 32])]
    weights = [numpy_helper.from_array(np.zeros(591, np.uint8), "W")]  # one tile, one block: 592 bytes
    if fed == "at run time":
        inputs.append(helper.make_tensor_value_info("W", TensorProto.UINT8, [592]))
        weights = []
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 16])],
                              weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(node.domain, 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(LIBRARY))
    expected = "W must be an initializer" if fed == "at run time" else "W is not K x N weights in this kernel's layout"
    with pytest.raises(Exception, match=expected):
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags")), set())


def test_the_library_is_built_on_every_cpu_that_runs_it():
    """Where the CPU has AVX-512 VNNI on x86-64 and a C compiler is here (the suite's set-up installs Kiln
    with it), a missing library is a broken install, not a reason for the kernel tests to skip."""
    import platform
    import shutil

    if os.environ.get(cpu_kernels.DISABLE_VARIABLE) == "0":
        pytest.skip("KILN_CPU_KERNELS=0: the kernels are turned off, as on a CPU without them")
    if platform.machine() != "x86_64" or "avx512_vnni" not in _cpu_flags():
        pytest.skip(f"this CPU ({platform.machine()}) has no AVX-512 VNNI: the kernels do not run here")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: Kiln installs without its kernels")
    assert LIBRARY is not None, f"Kiln's CPU kernels should run on this CPU but do not: {WHY_NOT}"


def test_kiln_cpu_kernels_0_turns_them_off(monkeypatch):
    """Turned off for a block, then back as the caller had it (a suite run with KILN_CPU_KERNELS=0 too)."""
    with monkeypatch.context() as patched:
        patched.setenv(cpu_kernels.DISABLE_VARIABLE, "0")
        cpu_kernels.library.cache_clear()
        assert cpu_kernels.library() == (None, "KILN_CPU_KERNELS=0")
    cpu_kernels.library.cache_clear()
    assert cpu_kernels.library() == (LIBRARY, WHY_NOT)


@needs_kernels
def test_a_graph_with_bf16_activations_runs_wherever_the_library_does(monkeypatch):
    """Without AVX-512 BF16 the bf16 op runs on FMAs (the same numbers: below), so a variant's kernels'
    graph is run on any host the library runs on; KILN_CPU_KERNELS_BF16=fma takes that path here too."""
    from runtime.backends.onnxruntime import kernel_library
    from runtime.manifest import Variant

    entry = Variant.of("v", {"status": "built", "kernel_model": "variants/v/model_kernels.onnx",
                             "kernel_activations": cpu_kernels.BF16_ACTIVATIONS})
    monkeypatch.setenv(cpu_kernels.BF16_PATH_VARIABLE, "fma")
    assert cpu_kernels.bf16() is False
    assert kernel_library(entry) == LIBRARY


@needs_kernels
def test_a_library_built_from_other_sources_is_not_run(monkeypatch):
    """The library says which version of the ops it was built from; a stale build (an editable checkout
    not reinstalled) would compute other numbers than the manifest promises, so it is not loaded."""
    monkeypatch.setattr(cpu_kernels, "LIBRARY_VERSION", cpu_kernels.LIBRARY_VERSION + 1)
    cpu_kernels.library.cache_clear()
    try:
        path, why = cpu_kernels.library()
        assert path is None and why.endswith("built from other sources than this Kiln's: reinstall Kiln to rebuild it")
    finally:
        monkeypatch.undo()
        cpu_kernels.library.cache_clear()
    assert cpu_kernels.library() == (LIBRARY, WHY_NOT)


def _resident_mib() -> float:
    """This process's resident memory, after the C heap gives back what it holds free (glibc keeps freed
    blocks of a session's load, 0 to 3 copies of the test's 19 MB weights depending on the order of
    allocations; a leak is memory still in use)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@needs_kernels
def test_a_sessions_weights_go_with_it(monkeypatch):
    """The 8-bit op copies its weights into memory of the library's own, on 2 MB pages
    (KILN_KERNEL_WEIGHTS=mapped leaves them where ONNX Runtime put them): the same numbers, bit for bit,
    and dropping the session gives that memory back, so sessions made and dropped one after another
    do not add up."""
    rng = np.random.default_rng(3)
    k, n = 2048, 8192  # 19 MB of packed weights, about a third of a chunk of 64 MB
    codes = rng.integers(0, 256, (n, k // 32, 32), dtype=np.uint8)
    scales = (rng.random(n * (k // 32)) * 0.01 + 0.001).astype(np.float32)
    x = rng.standard_normal((1, 4, k)).astype(np.float32)
    monkeypatch.setenv("KILN_KERNEL_WEIGHTS", "mapped")
    mapped = session("kiln", codes, scales, None).run(None, {"A": x})[0]
    monkeypatch.delenv("KILN_KERNEL_WEIGHTS")
    resident = []
    for _ in range(6):
        kiln = session("kiln", codes, scales, None)
        assert np.array_equal(kiln.run(None, {"A": x})[0], mapped)
        del kiln
        resident.append(_resident_mib())
    # The first session may leave allocations that stay (ONNX Runtime's arenas, the allocator's own
    # pools: 18 MiB once on an Intel Xeon, none on an AMD EPYC); a leak grows with every session after
    # it. Four sessions past the first would hold 4 x 19 MB more; a one-time allocation holds nothing.
    growth_after_first = resident[-1] - resident[1]
    assert growth_after_first < 19, resident


@needs_kernels
def test_a_nan_activation_gives_nan_outputs_not_numbers():
    """A NaN in a block must reach the output as it would in fp32, where int8 rounding would hide it
    (a NaN code saturates to -128) and the compiler's finiteness check would pass a broken graph."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (32, 2, 32), dtype=np.uint8)
    scales = np.full(64, 0.01, np.float32)
    kiln = session("kiln", codes, scales, None)
    x = rng.standard_normal((1, 2, 64)).astype(np.float32)
    x[0, 0, 40] = np.nan
    y = kiln.run(None, {"A": x})[0]
    assert np.isnan(y[0, 0]).all() and np.isfinite(y[0, 1]).all()


def swiglu_sessions() -> tuple[ort.InferenceSession, ort.InferenceSession]:
    """ai.kiln::SwiGLU alone, and what it replaces: a Split into halves, Sigmoid, Mul, Mul (ONNX Runtime
    fuses the Sigmoid and its Mul into QuickGelu), X [b, s, 2n] -> Y [b, s, n]."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b", "s", "two_n"])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)
    ours = helper.make_graph([helper.make_node(cpu_kernels.SWIGLU_OP, ["X"], ["Y"], domain=cpu_kernels.DOMAIN)],
                             "ours", [x], [y])
    theirs = helper.make_graph([helper.make_node("Split", ["X"], ["g", "u"], axis=-1, num_outputs=2),
                                helper.make_node("Sigmoid", ["g"], ["s"]), helper.make_node("Mul", ["g", "s"], ["silu"]),
                                helper.make_node("Mul", ["silu", "u"], ["Y"])], "theirs", [x], [y])
    sessions = []
    for graph, domain in ((ours, cpu_kernels.DOMAIN), (theirs, "")):
        opsets = [helper.make_opsetid("", 18)] + [helper.make_opsetid(domain, 1)] * bool(domain)
        model = helper.make_model(graph, opset_imports=opsets)
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        if domain:
            options.register_custom_ops_library(str(LIBRARY))
        sessions.append(ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]))
    return sessions[0], sessions[1]


@needs_kernels
def test_swiglu_writes_what_the_split_sigmoid_and_muls_write_bit_for_bit():
    ours, theirs = swiglu_sessions()
    rng = np.random.default_rng(5)
    # one row of SmolLM2's width (inline), many rows (the threads), a width past the op's column chunks
    # with a part-filled vector (2 * 1037), and values past the logistic's clamp at +-18
    for shape in ((1, 1, 3072), (2, 36, 3072), (3, 5, 2074), (1, 2, 16)):
        x = (rng.standard_normal(shape) * 6).astype(np.float32)
        x.reshape(-1)[:4] = [0.0, -0.0, 40.0, -40.0]
        expected, got = theirs.run(None, {"X": x})[0], ours.run(None, {"X": x})[0]
        assert got.shape == expected.shape == (*shape[:2], shape[2] // 2)
        assert np.array_equal(got, expected)
    with pytest.raises(Exception, match="ai.kiln::SwiGLU: X's last dimension must be even"):
        ours.run(None, {"X": np.zeros((1, 1, 7), np.float32)})


def fp32_sessions(weights: np.ndarray, transposed: bool = False, threads: int = 2
                  ) -> tuple[ort.InferenceSession, ort.InferenceSession]:
    """ai.kiln::MatMulFp32 over these weights ([K, N], or [N, K] with transB), and ONNX's MatMul (after a
    Transpose) over the same."""
    k, n = weights.shape[::-1] if transposed else weights.shape
    ours = helper.make_node(cpu_kernels.FP32_MATMUL_OP, ["A", "W"], ["Y"], domain=cpu_kernels.DOMAIN,
                            **({"transB": 1} if transposed else {}))
    theirs = [helper.make_node("Transpose", ["W"], ["WT"]), helper.make_node("MatMul", ["A", "WT"], ["Y"])] \
        if transposed else [helper.make_node("MatMul", ["A", "W"], ["Y"])]
    initializer = [numpy_helper.from_array(weights, "W")]
    graph = helper.make_graph(theirs, "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["b", "s", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["b", "s", n])], initializer)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    mlas = ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString(),
                                options, providers=["CPUExecutionProvider"])
    return one_node_session(ours, initializer, k, n, threads), mlas


@needs_kernels
@pytest.mark.parametrize("k, n, transposed", [(576, 960, False), (1536, 70, False), (200, 333, True), (7, 5, False)])
def test_the_fp32_matmul_sums_as_closely_as_mlas_and_each_row_alone_the_same(k, n, transposed):
    """MatMulFp32 sums each block of 128 rows of W in one chain of FMAs and adds the blocks: against exact
    sums, no further off than MLAS's MatMul (which adds blocks too). A row's outputs are the same bits
    alone, in any batch and on any number of threads: what keeps an fp32 variant's greedy tokens the same
    in a batch as alone. Shapes: SmolLM2's; K past 1,536 in blocks of 128 with N a part-filled panel of 16
    columns; a transposed W [N, K] (a tied LM head); fewer rows and columns than a panel."""
    rng = np.random.default_rng(k + n)
    weights = rng.standard_normal((n, k) if transposed else (k, n)).astype(np.float32)
    exact_weights = (weights.T if transposed else weights).astype(np.float64)
    ours, mlas = fp32_sessions(weights, transposed)
    one_thread = fp32_sessions(weights, transposed, threads=1)[0]
    for rows in (1, 5, 8, 45, 200):  # a row; a tile of 4 and part of one; a decode batch; a prompt; rows past 96
        x = rng.standard_normal((1, rows, k)).astype(np.float32)
        exact = x.astype(np.float64) @ exact_weights
        got, theirs = ours.run(None, {"A": x})[0], mlas.run(None, {"A": x})[0]
        assert got.shape == (1, rows, n)
        assert np.abs(got - exact).max() <= 1.2 * np.abs(theirs - exact).max() + 1e-6
        alone = np.concatenate([ours.run(None, {"A": x[:, i:i + 1]})[0] for i in range(rows)], axis=1)
        assert np.array_equal(alone, got)
        assert np.array_equal(one_thread.run(None, {"A": x})[0], got)


@needs_kernels
def test_the_fp32_matmul_refuses_weights_it_cannot_take_in_one_line():
    for weights, inputs, expected in (
            (np.zeros((4, 3, 2), np.float32), [], "W must be K x N"),
            (None, [helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 3])], "W must be an initializer")):
        node = helper.make_node(cpu_kernels.FP32_MATMUL_OP, ["A", "W"], ["Y"], domain=cpu_kernels.DOMAIN)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, 4]), *inputs],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                                  [] if weights is None else [numpy_helper.from_array(weights, "W")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(node.domain, 1)])
        options = ort.SessionOptions()
        options.register_custom_ops_library(str(LIBRARY))
        with pytest.raises(Exception, match=f"ai.kiln::MatMulFp32: {expected}"):
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    node = helper.make_node(cpu_kernels.FP32_MATMUL_OP, ["A", "W"], ["Y"], domain=cpu_kernels.DOMAIN)
    ours = one_node_session(node, [numpy_helper.from_array(np.ones((4, 3), np.float32), "W")], "k", 3)
    with pytest.raises(Exception, match="ai.kiln::MatMulFp32: A's last dimension is not W's first"):
        ours.run(None, {"A": np.zeros((1, 1, 5), np.float32)})


def int4_session(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray,
                 offsets: np.ndarray) -> ort.InferenceSession:
    n, blocks, _ = codes.shape
    k = blocks * 32
    node = helper.make_node(cpu_kernels.INT4_BLOCKS_OP, ["A", "W"], ["Y"], domain=cpu_kernels.DOMAIN, K=k, N=n)
    weights = [numpy_helper.from_array(cpu_kernels.pack_int4_blocks(codes, scales, zero_points, offsets), "W")]
    return one_node_session(node, weights, k, n)


def int4_reference(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray,
                   offsets: np.ndarray) -> np.ndarray:
    """What MatMulInt4Blocks computes, in float64: the activations quantized per block of 32 as MLAS
    quantizes them (scale max|x| / 127, rounded to nearest even) times d * (q - z), plus m times the
    block's exact sum; d and m as the kernel holds them, in fp16."""
    n, blocks, _ = codes.shape
    xb = x.reshape(-1, blocks, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.maximum(amax, np.float32(1e-30)), 0).astype(np.float32)
    q = np.clip(np.rint(xb * inverse), -127, 127)
    a_scale = (amax / np.float32(127)).astype(np.float64)[..., 0]  # [rows, blocks]
    centered = codes.astype(np.float64) - zero_points[..., None]
    dots = np.einsum("rbk,nbk->rbn", q, centered)
    y = (dots * a_scale[..., None] * scales.T[None].astype(np.float16).astype(np.float64)).sum(1)
    y += np.einsum("rb,nb->rn", xb.astype(np.float64).sum(-1), offsets.astype(np.float16).astype(np.float64))
    return y.reshape(*x.shape[:-1], n)


def random_int4_weights(rng: np.random.Generator, n: int, k: int, dtype: type = np.float32
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """4-bit blocks of 32 as pack_int4_blocks takes them: codes, scales, integer zero points, and offsets of at
    most half a step; scales and offsets held in `dtype` (fp16: as the kernel holds them, exactly)."""
    codes = rng.integers(0, 16, (n, k // 32, 32), dtype=np.uint8)
    scales = (rng.random((n, k // 32)) * 0.01 + 0.001).astype(dtype).astype(np.float32)
    zero_points = rng.integers(4, 12, (n, k // 32), dtype=np.uint8)
    offsets = (scales * (rng.random((n, k // 32)) - 0.5)).astype(dtype).astype(np.float32)
    return codes, scales, zero_points, offsets


@needs_kernels
@pytest.mark.parametrize("k, n", [(64, 40), (576, 960), (1536, 70)])
def test_the_4bit_kernel_computes_its_blocks_and_each_row_alone_the_same(k, n):
    rng = np.random.default_rng(k * n)
    codes, scales, zero_points, offsets = random_int4_weights(rng, n, k)
    kiln = int4_session(codes, scales, zero_points, offsets)
    for rows in (1, 3, 9, 70, 130):
        x = rng.standard_normal((1, rows, k)).astype(np.float32)
        x[0, 0, :32] = 0
        expected, got = int4_reference(x, codes, scales, zero_points, offsets), kiln.run(None, {"A": x})[0]
        assert got.shape == (1, rows, n)
        assert np.abs(got - expected).max() <= 2e-6 * np.abs(expected).max()
        alone = np.concatenate([kiln.run(None, {"A": x[:, i:i + 1]})[0] for i in range(rows)], axis=1)
        assert np.array_equal(alone, got)


def test_4bit_codes_past_15_and_scales_past_fp16_are_refused():
    codes, ones, zeros = np.full((16, 1, 32), 15, np.uint8), np.ones((16, 1)), np.zeros((16, 1), np.uint8)
    with pytest.raises(ValueError, match="0 to 15"):
        cpu_kernels.pack_int4_blocks(codes + 1, ones, zeros, ones)
    with pytest.raises(ValueError, match="fp16's range"):
        cpu_kernels.pack_int4_blocks(codes, ones * 1e5, zeros, ones)


needs_bf16 = pytest.mark.skipif(LIBRARY is None or not cpu_kernels.bf16(),
                                reason=f"Kiln's CPU kernels with AVX-512 BF16: {WHY_NOT or 'this CPU has no AVX-512 BF16'}")
# MatMulInt4BlocksBf16's two ways to its numbers: AVX-512 BF16's instructions, and FMAs (a CPU without them)
BF16_PATHS = [pytest.param("instructions", marks=needs_bf16), pytest.param("fma", marks=needs_kernels)]


@pytest.fixture
def bf16_path(request, monkeypatch):
    """The path the sessions a test creates take (the library reads KILN_CPU_KERNELS_BF16 per session)."""
    if request.param == "fma":
        monkeypatch.setenv(cpu_kernels.BF16_PATH_VARIABLE, "fma")
    return request.param


def bf16_session(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray, offsets: np.ndarray,
                 gated: int = 0, threads: int = 2) -> ort.InferenceSession:
    n, blocks, _ = codes.shape
    k = blocks * 32
    node = helper.make_node(cpu_kernels.INT4_BF16_OP, ["A", "W"], ["Y"], domain=cpu_kernels.DOMAIN, K=k, N=n,
                            gated=gated)
    packed = cpu_kernels.bf16_layout(cpu_kernels.pack_int4_blocks(codes, scales, zero_points, offsets), k)
    return one_node_session(node, [numpy_helper.from_array(packed, "W")], k, n // 2 if gated else n, threads)


@pytest.mark.parametrize("bf16_path", BF16_PATHS, indirect=True)
@pytest.mark.parametrize("k, n", [(64, 40), (576, 960), (1536, 70)])
def test_the_4bit_kernel_with_bf16_activations_multiplies_the_exact_weights_and_each_row_alone_the_same(k, n, bf16_path):
    """MatMulInt4BlocksBf16's only rounding before the fp32 sums is the activations' to bf16: the output is
    x rounded to bf16 times the weights d * (q - z) + m exactly, to fp32's summing error."""
    rng = np.random.default_rng(k + 7 * n)
    codes, scales, zero_points, offsets = random_int4_weights(rng, n, k, np.float16)
    weights = (scales[..., None] * (codes.astype(np.float64) - zero_points[..., None]) + offsets[..., None])
    weights = weights.reshape(n, k).T
    kiln = bf16_session(codes, scales, zero_points, offsets)
    int8 = int4_session(codes, scales, zero_points, offsets)
    for rows in (1, 3, 9, 70, 130):
        x = rng.standard_normal((1, rows, k)).astype(np.float32)
        x[0, 0, :32] = 0
        expected = as_bf16(x).astype(np.float64) @ weights
        got = kiln.run(None, {"A": x})[0]
        assert got.shape == (1, rows, n)
        error = np.abs(got - expected).max() / np.abs(expected).max()
        assert error < 1e-5
        # int8 activation blocks: a hundred times further off the same weights
        assert np.abs(int8.run(None, {"A": x})[0] - x.astype(np.float64) @ weights).max() / np.abs(expected).max() > 100 * error
        alone = np.concatenate([kiln.run(None, {"A": x[:, i:i + 1]})[0] for i in range(rows)], axis=1)
        assert np.array_equal(alone, got)
    x = rng.standard_normal((1, 2, k)).astype(np.float32)
    x[0, 1, 5] = np.nan
    out = kiln.run(None, {"A": x})[0]
    assert np.isfinite(out[0, 0]).all() and np.isnan(out[0, 1]).all()


@pytest.mark.parametrize("bf16_path", BF16_PATHS, indirect=True)
def test_the_bf16_kernel_gated_writes_silu_of_its_gate_tiles_times_its_up_tiles(bf16_path):
    """gated = 1: tiles of 16 columns alternate gate and up; the op writes silu(gate) * up, the same
    numbers as the ungated op's columns (the same sums) through the SiLU, and a row alone the same."""
    k, n = 576, 128
    rng = np.random.default_rng(11)
    weights = random_int4_weights(rng, n, k)
    gated, plain = bf16_session(*weights, gated=1), bf16_session(*weights)
    for rows in (1, 5, 40):
        x = rng.standard_normal((1, rows, k)).astype(np.float32)
        sums = plain.run(None, {"A": x})[0].reshape(rows, n // 32, 2, 16)
        gate, up = sums[:, :, 0].reshape(1, rows, -1), sums[:, :, 1].reshape(1, rows, -1)
        got = gated.run(None, {"A": x})[0]
        assert got.shape == (1, rows, n // 2)
        np.testing.assert_allclose(got, gate / (1 + np.exp(-gate.astype(np.float64))) * up, rtol=1e-5, atol=1e-6)
        alone = np.concatenate([gated.run(None, {"A": x[:, i:i + 1]})[0] for i in range(rows)], axis=1)
        assert np.array_equal(alone, got)


@needs_bf16
def test_the_bf16_kernel_on_fmas_gives_the_instructions_numbers_bit_for_bit(monkeypatch):
    """A CPU without AVX-512 BF16 computes MatMulInt4BlocksBf16 with FMAs: each VDPBF16PS pair as two
    fused multiply-adds in the instruction's order, its activations rounded as VCVTNEPS2BF16 rounds them,
    denormals flushed as both flush them. The outputs are the same bits, so a variant's numbers do not
    depend on the host: here for ordinary rows and for rows near fp32's limits (denormal and tiny
    activations, whose sums fall below the smallest normal; huge ones; infinities and NaN)."""
    k, n = 576, 128
    rng = np.random.default_rng(5)
    weights = random_int4_weights(rng, n, k)
    rows = rng.standard_normal((40, k)).astype(np.float32)
    rows[1] *= np.float32(1e-38)  # mostly denormal
    rows[2] *= np.float32(2e-36)  # normal, products and their sums near the smallest normal
    rows[3] *= np.float32(1e30)
    rows[4, ::7] = np.inf
    rows[5, 3] = np.nan
    rows[6] *= np.float32(300)  # gates far below zero: silu near and under the smallest normal
    rows[7, ::2] = 0
    rows[8] = rows[8] * np.float32(1e-3) + np.float32(1)  # values on bf16's rounding ties
    x = rows[None]

    def outputs() -> list[np.ndarray]:
        sessions = [bf16_session(*weights), bf16_session(*weights, gated=1)]
        return [session.run(None, {"A": part})[0] for session in sessions for part in (x, x[:, :1], x[:, :9])]

    instructions = outputs()
    monkeypatch.setenv(cpu_kernels.BF16_PATH_VARIABLE, "fma")
    on_fmas = outputs()
    for a, b in zip(instructions, on_fmas, strict=True):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    assert np.isnan(instructions[0][0, 5]).all() and np.isfinite(instructions[0][0, 0]).all()


@pytest.mark.parametrize("bf16_path", BF16_PATHS, indirect=True)
def test_the_bf16_kernel_gives_the_thread_its_own_floating_point_modes_back(bf16_path):
    """Its shards flush denormals to zero (as VDPBF16PS does) on whatever thread runs them, the caller's
    included (one thread: ONNX Runtime runs the op on it): afterwards that thread's denormals are kept."""
    k, n = 64, 32
    session = bf16_session(*random_int4_weights(np.random.default_rng(3), n, k), threads=1)
    tiny = np.full(8, 1e-38, np.float32)
    assert (tiny * np.float32(0.5) > 0).all()  # a denormal, not flushed
    session.run(None, {"A": np.ones((1, 3, k), np.float32)})
    assert (tiny * np.float32(0.5) > 0).all()
