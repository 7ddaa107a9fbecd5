"""Decode steps of two or more Kiln variants side by side, with the order they were loaded in cancelled.

    python bench/ab_step.py NAME=ARTIFACT:VARIANT NAME=ARTIFACT:VARIANT [...] [--batch 1 32]
                            [--threads 1 2] [--rounds 15] [--steps 15] [--past 45]
                            [--output bench/results/ab_step.json]

For a compiler change measured against the build it replaces (compile both, then e.g.
`new=out/a:cpu-int4 old=/tmp/before:cpu-int4`). The step: `--batch` rows, one new token each after
`--past` cached tokens, through Kiln's own backend (runtime.backend: KV buffers bound once, logits
into an array of its own), the same step every time.

Why a tool of its own: on the 2-core VM this project is measured on, one graph loaded twice in one
process ran 12% to 16% slower a step in the session created first than in the one created second
(1 thread, 30 interleaved rounds, either run order; 4% to 9% with 2 threads), so a build loaded
first loses. So each (batch, threads) cell runs once per rotation of the load order, each rotation
in a fresh process, and within a process the rounds interleave the variants with the run order
rotating too. Reported: the median step over all rounds of all processes, each variant's ratio to
the first one named, and each variant's median by the position it was loaded in (the order effect,
measured in the same run). Writes JSON and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load(spec: str, threads: int, verify: bool = False):
    """The backend for ARTIFACT:VARIANT (its files checked once, by the parent process)."""
    from runtime.artifact import Artifact
    from runtime.backend import open_backend
    from runtime.errors import KilnError

    folder, _, variant = spec.rpartition(":")
    try:
        artifact = Artifact.open(folder, verify=verify)
        return open_backend(artifact.folder, artifact.variant(variant), threads=threads)
    except KilnError as exc:
        raise SystemExit(f"error: {exc}") from None


def worker(order: list[tuple[str, str]], batch: int, threads: int, rounds: int, steps: int, past: int) -> dict:
    """Load the variants in `order`, then `rounds` rounds of `steps` timed steps each (after 3 untimed),
    the run order rotating by one each round: each step's milliseconds, by variant."""
    import numpy as np

    backends = [(name, load(spec, threads)) for name, spec in order]
    feeds = {}
    for name, backend in backends:
        cache = backend.new_cache(batch, past + 1 + steps)
        token = np.full((batch, 1), 42, np.int64)
        mask = np.ones((batch, past + 1), np.int64)
        position = np.full((batch, 1), past, np.int64)
        feeds[name] = (backend, token, mask, position, cache)
    times: dict[str, list[float]] = {name: [] for name, _ in backends}
    for number in range(rounds):
        for index in range(len(backends)):
            name = backends[(index + number) % len(backends)][0]
            backend, token, mask, position, cache = feeds[name]
            for _ in range(3):
                backend.run(token, mask, position, cache)
            start = time.perf_counter()
            for _ in range(steps):
                backend.run(token, mask, position, cache)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return times


def cell(variants: list[tuple[str, str]], batch: int, threads: int, rounds: int, steps: int, past: int) -> dict:
    """One (batch, threads) cell: a fresh process per rotation of the load order."""
    pooled: dict[str, list[float]] = {name: [] for name, _ in variants}
    by_position: dict[str, list[float]] = {name: [0.0] * len(variants) for name, _ in variants}
    for shift in range(len(variants)):
        order = variants[shift:] + variants[:shift]
        job = json.dumps({"order": order, "batch": batch, "threads": threads, "rounds": rounds, "steps": steps,
                          "past": past})
        done = subprocess.run([sys.executable, __file__, "--worker", job], capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "a worker failed")
        times = json.loads(done.stdout.strip().splitlines()[-1])
        for position, (name, _) in enumerate(order):
            pooled[name] += times[name]
            by_position[name][position] = statistics.median(times[name])
        print(f"batch {batch}, {threads} thread(s): load order {', '.join(n for n, _ in order)} done", file=sys.stderr)
    first = statistics.median(pooled[variants[0][0]])
    return {"batch": batch, "threads": threads, "variants": {
        name: {"median_ms": statistics.median(pooled[name]), "ratio_to_first": statistics.median(pooled[name]) / first,
               "median_ms_by_load_position": by_position[name], "rounds": len(pooled[name])}
        for name, _ in variants}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help="NAME=ARTIFACT:VARIANT, two or more")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15, help="rounds per load order")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per round")
    parser.add_argument("--past", type=int, default=45, help="cached tokens before each step")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "ab_step.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        print(json.dumps(worker([tuple(v) for v in job["order"]], job["batch"], job["threads"], job["rounds"],
                                job["steps"], job["past"])))
        return
    variants = []
    for text in args.variants:
        name, equals, spec = text.partition("=")
        if not equals or ":" not in spec:
            raise SystemExit(f"error: {text!r} is not NAME=ARTIFACT:VARIANT, e.g. new=out/a:cpu-int4")
        variants.append((name, spec))
    if len(variants) < 2:
        raise SystemExit("error: name two or more variants to compare, e.g. new=out/a:cpu-int4 old=/tmp/b:cpu-int4")
    for _, spec in variants:  # a bad name or a damaged artifact fails here, before any timing
        load(spec, 1, verify=True).close()
    cells = [cell(variants, batch, threads, args.rounds, args.steps, args.past)
             for batch in args.batch for threads in args.threads]
    result = {"past": args.past, "steps": args.steps, "rounds_per_order": args.rounds,
              "variants": dict(variants), "cells": cells}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    names = [name for name, _ in variants]
    print(f"| batch | threads | {' | '.join(f'{n} ms' for n in names)} | "
          f"{' | '.join(f'{n} / {names[0]}' for n in names[1:])} | by load position (ms, 1st/2nd/...) |")
    print("| ---: | ---: |" + " ---: |" * (2 * len(names) - 1) + " --- |")
    for c in cells:
        v = c["variants"]
        positions = "; ".join(f"{n} " + "/".join(f"{x:.2f}" for x in v[n]["median_ms_by_load_position"])
                              for n in names)
        medians = " | ".join(f"{v[n]['median_ms']:.2f}" for n in names)
        ratios = " | ".join(f"{v[n]['ratio_to_first']:.3f}" for n in names[1:])
        print(f"| {c['batch']} | {c['threads']} | {medians} | {ratios} | {positions} |")


if __name__ == "__main__":
    main()
