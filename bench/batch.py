"""Bulk offline inference: `kiln batch` against a Python loop of static batches, and on Ray.

    python bench/batch.py [--artifact out/smollm2-135m-instruct] [--variants cpu-fp32 cpu-int8]
                          [--rows 1000] [--new-tokens 64] [--threads 2] [--static 32 64]
                          [--batch-sizes 32 64] [--ray-workers 2]

For each variant, the same --rows prompts of 30 to 60 tokens (token ids, so every run sees the same
tokens), greedy, exactly --new-tokens generated (ignore_eos: every row costs the same):
- static N: a Python loop calling Generator.generate on consecutive batches of N rows (in process,
  the model loaded once, not timed);
- kiln batch B: the command on a JSONL file of those rows, --batch-size B, in a subprocess; timed by
  its own summary line (loading the model, reading, answering, writing and fsyncing: all of it but
  the scan of INPUT and Python's start);
- kiln batch --ray --workers W: the same on a local Ray instance the command starts (on 2 cores it
  is expected to be slower: it is there for clusters).
One run at a time (2 cores). Writes bench/results/batch.json and prints a table with rows/s, output
tokens/s and each run's ratio to the best static batch. Target (issue 13): kiln batch at least as
fast as the best static batch size.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from generate import make_prompts  # noqa: E402

SUMMARY = re.compile(r"(\d[\d,]*) done, (\d[\d,]*) failed.* in ([\d.]+) s")


def static_run(artifact: Path, variant: str, prompts: list[list[int]], size: int, new_tokens: int,
               threads: int) -> dict:
    from runtime.generator import Generator
    from runtime.sampling import SamplingParams

    generator = Generator.load(artifact, variant, threads=threads, max_batch_size=size)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    generator.warmup()
    start, tokens = time.perf_counter(), 0
    for first in range(0, len(prompts), size):
        tokens += sum(r.generated_tokens for r in generator.generate(prompts[first:first + size], params))
    seconds = time.perf_counter() - start
    return {"run": f"static {size}", "seconds": seconds, "rows": len(prompts), "output_tokens": tokens}


def batch_run(artifact: Path, variant: str, source: Path, folder: Path, threads: int, *extra: str) -> dict:
    output = folder / f"out-{time.monotonic_ns()}.jsonl"
    done = subprocess.run([sys.executable, "-m", "runtime.kiln_cli", "batch", str(artifact), str(source),
                           str(output), "--variant", variant, "--threads", str(threads), *extra],
                          capture_output=True, text=True, cwd=ROOT)
    match = SUMMARY.search(done.stderr)
    if done.returncode != 0 or not match:
        raise RuntimeError(f"kiln batch failed ({done.returncode}): {done.stderr[-2000:]}")
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    return {"run": "kiln batch " + " ".join(extra), "seconds": float(match.group(3)), "rows": len(lines),
            "output_tokens": sum(line["usage"]["completion_tokens"] for line in lines)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=ROOT / "out" / "smollm2-135m-instruct")
    parser.add_argument("--variants", nargs="+", default=["cpu-fp32", "cpu-int8"])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--static", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--ray-workers", type=int, default=2, help="0 skips the Ray run")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "batch.json")
    args = parser.parse_args()

    from runtime.artifact import Artifact
    from runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(Artifact.open(args.artifact).tokenizer_dir)
    prompts = make_prompts(tokenizer, args.rows)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        source = folder / "in.jsonl"
        source.write_text("".join(json.dumps({"id": i, "prompt": p, "max_tokens": args.new_tokens, "temperature": 0,
                                              "ignore_eos": True}) + "\n" for i, p in enumerate(prompts)))
        for variant in args.variants:
            runs = [static_run(args.artifact, variant, prompts, size, args.new_tokens, args.threads)
                    for size in args.static]
            runs += [batch_run(args.artifact, variant, source, folder, args.threads, "--batch-size", str(size))
                     for size in args.batch_sizes]
            if args.ray_workers:
                runs.append(batch_run(args.artifact, variant, source, folder, args.threads, "--ray",
                                      "--workers", str(args.ray_workers)))
            best = max(r["output_tokens"] / r["seconds"] for r in runs if r["run"].startswith("static"))
            for run in runs:
                run.update(variant=variant, rows_per_s=run["rows"] / run["seconds"],
                           output_tokens_per_s=run["output_tokens"] / run["seconds"])
                run["vs_best_static"] = run["output_tokens_per_s"] / best
                rows.append(run)
                print(f"{variant:10} {run['run']:34} {run['rows_per_s']:7.2f} rows/s "
                      f"{run['output_tokens_per_s']:8.1f} tok/s  x{run['vs_best_static']:.2f}", flush=True)
    args.output.write_text(json.dumps({"artifact": str(args.artifact), "threads": args.threads,
                                       "new_tokens": args.new_tokens, "prompts": args.rows, "rows": rows},
                                      indent=2) + "\n")
    print(table(rows))


def table(rows: list[dict]) -> str:
    lines = ["| variant | run | rows/s | output tok/s | vs best static |", "|---|---|---:|---:|---:|"]
    lines += [f"| {r['variant']} | {r['run']} | {r['rows_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
              f"{r['vs_best_static']:.2f} |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
