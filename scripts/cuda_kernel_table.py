"""Write compiler/data/onnxruntime_gpu_<version>_cuda_kernels.json: every kernel ONNX Runtime's CUDA
execution provider registers (default and com.microsoft domains), with its opset range and the exact
types of each registration, as the installed onnxruntime-gpu reports them. compile-model's placement
check (compiler/cuda_placement.py) reads it to name the nodes a CUDA variant would leave on the CPU.

    python scripts/cuda_kernel_table.py                  # from the onnxruntime-gpu installed here
    python scripts/cuda_kernel_table.py --dump defs.json  # from a dump written elsewhere (below)

Listing the registry needs the CUDA provider to load, not a GPU to run on. The table in the tree
was made on a host without one: the 1.31.1 wheel in a virtual environment, its CUDA, cuBLAS, cuDNN
and TensorRT libraries replaced by stubs that return success (each entry point the provider imports,
from `readelf --dyn-syms`), LD_LIBRARY_PATH pointing at them, and this dump:

    import json, onnxruntime.capi.onnxruntime_pybind11_state as rt
    json.dump([{"op": d.op_name, "domain": d.domain, "provider": d.provider,
                "version_range": list(d.version_range),
                "type_constraints": {k: sorted(v) for k, v in d.type_constraints.items()}}
               for d in rt.get_all_opkernel_def()], open("defs.json", "w"))

It agrees row for row with docs/OperatorKernels.md as ONNX Runtime's own generator writes it for
that wheel, where the document lists each constraint's types as a union over registrations.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNBOUNDED = 2147483647  # INT_MAX: ONNX Runtime's "and every later opset"
DOMAINS = ("", "com.microsoft")


def kernel_defs() -> tuple[list[dict], str]:
    import onnxruntime
    import onnxruntime.capi.onnxruntime_pybind11_state as rt

    defs = [{"op": d.op_name, "domain": d.domain, "provider": d.provider, "version_range": list(d.version_range),
             "type_constraints": {k: sorted(v) for k, v in d.type_constraints.items()}}
            for d in rt.get_all_opkernel_def()]
    return defs, onnxruntime.__version__


def table(defs: list[dict], version: str, build: str) -> dict:
    kernels: dict[str, dict[str, list]] = {}
    for row in defs:
        if row["provider"] != "CUDAExecutionProvider" or row["domain"] not in DOMAINS:
            continue
        low, high = row["version_range"]
        types = {name: [t.removeprefix("tensor(").removesuffix(")") for t in allowed]
                 for name, allowed in sorted(row["type_constraints"].items())}
        kernels.setdefault(row["domain"], {}).setdefault(row["op"], []).append(
            [low, None if high >= UNBOUNDED else high, types])
    return {"onnxruntime_gpu": version, "build": build,
            "source": "get_all_opkernel_def() of the onnxruntime-gpu wheel: CUDAExecutionProvider rows of the "
                      "default and com.microsoft domains (scripts/cuda_kernel_table.py)",
            "kernels": {domain: dict(sorted(ops.items())) for domain, ops in sorted(kernels.items())}}


def write(data: dict, path: Path) -> None:
    """One op a line: the file diffs by op when a new release is tabled."""
    lines = [json.dumps({k: v for k, v in data.items() if k != "kernels"})[:-1] + ', "kernels": {']
    domains = list(data["kernels"].items())
    for d, (domain, ops) in enumerate(domains):
        lines.append(f"  {json.dumps(domain)}: {{")
        items = list(ops.items())
        for i, (op, rows) in enumerate(items):
            lines.append(f"    {json.dumps(op)}: {json.dumps(rows, separators=(',', ':'))}"
                         + ("," if i < len(items) - 1 else ""))
        lines.append("  }" + ("," if d < len(domains) - 1 else ""))
    lines.append("}}")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dump", type=Path, help="a kernel-def dump (JSON) instead of the installed onnxruntime-gpu")
    parser.add_argument("--version", help="the onnxruntime-gpu release of the dump")
    parser.add_argument("--build", default="", help="its build, e.g. the git commit get_build_info() reports")
    args = parser.parse_args()
    if args.dump:
        if not args.version:
            parser.error("--dump needs --version")
        defs, version = json.loads(args.dump.read_text()), args.version
    else:
        defs, version = kernel_defs()
    path = ROOT / "compiler" / "data" / f"onnxruntime_gpu_{version}_cuda_kernels.json"
    write(table(defs, version, args.build), path)
    print(path)


if __name__ == "__main__":
    main()
