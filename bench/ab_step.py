"""Decode steps of two or more Kiln variants side by side, with the order they were loaded in cancelled.

    python bench/ab_step.py NAME=ARTIFACT:VARIANT NAME=ARTIFACT:VARIANT [...] [--batch 1 32]
                            [--threads 1 2] [--rounds 15] [--steps 15] [--past 45] [--alone]
                            [--output bench/results/ab_step.json]

For a compiler change measured against the build it replaces (compile both, then e.g.
`new=out/a:cpu-int4 old=/tmp/before:cpu-int4`). The step: `--batch` rows, one new token each after
`--past` cached tokens, through Kiln's own backend (runtime.backends.onnxruntime: KV buffers bound once, logits
into an array of its own), the same step every time. NAME=FOLDER names an onnxruntime-genai model
folder instead (one with genai_config.json, as bench/peers.py builds them): its graph driven as genai
drives it, past and present bound to one buffer per layer, logits into an array, no copy out.
NAME=ARTIFACT:VARIANT/FILE runs one graph file of the variant's rather than the one the host would
pick, e.g. `mlas=out/a:cpu-int8/model.onnx kiln=out/a:cpu-int8/model_kernels.onnx` (runtime/cpu_kernels.py).

Why a tool of its own: on the 2-core VM this project is measured on, one graph loaded twice in one
process ran 12% to 16% slower a step in the session created first than in the one created second
(1 thread, 30 interleaved rounds, either run order; 4% to 9% with 2 threads), so a build loaded
first loses. So each (batch, threads) cell runs once per rotation of the load order, each rotation
in a fresh process, and within a process the rounds interleave the variants with the run order
rotating too. Reported: the median step over all rounds of all processes, each variant's ratio to
the first one named, and each variant's median by the position it was loaded in (the order effect,
measured in the same run). Writes JSON and prints a Markdown table.

`--alone` runs each variant in a process of its own instead (one round per process, the variants'
processes alternating): two sessions in one process were measured to even out a gap that each alone
showed (int8 against genai's int8 at batch 1 on the AMD VM: level together, ~7% apart alone), and a
server runs one model per process.
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


class GenaiGraph:
    """An onnxruntime-genai model folder's graph behind the two calls worker() makes of a Kiln backend:
    run the way genai runs it with `past_present_share_buffer` (its KV buffers bound as both the past
    input and the present output of each layer, the mask's length saying how many slots are in use),
    with `threads` intra-op threads and one inter-op thread, as Kiln's backend and genai's CPU
    config both set them."""

    def __init__(self, folder: Path, threads: int) -> None:
        import onnxruntime as ort

        try:
            config = json.loads((folder / "genai_config.json").read_text())
            shared = config["search"].get("past_present_share_buffer")
            decoder, self.vocab_size = config["model"]["decoder"], int(config["model"]["vocab_size"])
            self.names = decoder["inputs"], decoder["outputs"]
            self.layers, self.kv_heads = decoder["num_hidden_layers"], decoder["num_key_value_heads"]
            self.head_dim, filename = decoder["head_size"], decoder["filename"]
        except (KeyError, TypeError, ValueError) as exc:
            raise SystemExit(f"error: {folder / 'genai_config.json'} is not an onnxruntime-genai decoder config "
                             f"({type(exc).__name__}: {exc})") from None
        if not shared:
            raise SystemExit(f"error: {folder}'s genai_config.json does not share past and present buffers "
                             "(search.past_present_share_buffer), the only way this tool runs a genai graph")
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(folder / filename), options, providers=["CPUExecutionProvider"])

    def new_cache(self, batch: int, capacity: int) -> dict:
        import numpy as np

        inputs, outputs = self.names
        binding = self.session.io_binding()
        buffers = []
        for layer in range(self.layers):
            for kind in ("key", "value"):
                buffer = np.zeros((batch, self.kv_heads, capacity, self.head_dim), np.float32)
                binding.bind_cpu_input(inputs[f"past_{kind}_names"] % layer, buffer)
                binding.bind_output(outputs[f"present_{kind}_names"] % layer, "cpu", 0, np.float32, buffer.shape,
                                    buffer.ctypes.data)
                buffers.append(buffer)
        logits = np.zeros((batch, 1, self.vocab_size), np.float32)
        binding.bind_output(outputs["logits"], "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
        return {"binding": binding, "arrays": (buffers, logits)}  # the arrays: the memory bound above

    def run(self, input_ids, attention_mask, position_ids, cache: dict):
        inputs = self.names[0]
        cache["binding"].bind_cpu_input(inputs["input_ids"], input_ids)
        cache["binding"].bind_cpu_input(inputs["attention_mask"], attention_mask)
        if "position_ids" in inputs:  # genai's builder derives positions in the graph; Kiln's graphs take them
            cache["binding"].bind_cpu_input(inputs["position_ids"], position_ids)
        self.session.run_with_iobinding(cache["binding"])
        return cache["arrays"][1], cache

    def close(self) -> None:
        self.session = None


def is_genai_folder(spec: str) -> bool:
    return (Path(spec) / "genai_config.json").is_file()


def load(spec: str, threads: int, verify: bool = False):
    """The backend for ARTIFACT:VARIANT, or a GenaiGraph for a genai model folder (an artifact's files
    checked once, by the parent process)."""
    from runtime.artifact import Artifact
    from runtime.backends.registry import open_backend
    from runtime.errors import KilnError

    if is_genai_folder(spec):
        return GenaiGraph(Path(spec), threads)
    folder, _, variant = spec.rpartition(":")
    variant, _, graph = variant.partition("/")
    try:
        artifact = Artifact.open(folder, verify=verify)
        entry = artifact.variant(variant)
        if graph:  # one graph file of the variant's, e.g. model.onnx where the host would run model_kernels.onnx
            from runtime.backends.onnxruntime import OnnxRuntimeBackend, kernel_interface
            from runtime.cpu_kernels import library_for

            path = artifact.folder / Path(entry.model).parent / graph
            kernels = library_for(path)  # the kernels' graph takes their interface (its KV cache may be fp16)
            return OnnxRuntimeBackend(path, kernel_interface(entry) if kernels else entry.interface,
                                      threads=threads, kernels=kernels)
        return open_backend(artifact.folder, entry, threads=threads)
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


def run_worker(order: list[tuple[str, str]], batch: int, threads: int, rounds: int, steps: int, past: int) -> dict:
    job = json.dumps({"order": order, "batch": batch, "threads": threads, "rounds": rounds, "steps": steps,
                      "past": past})
    done = subprocess.run([sys.executable, __file__, "--worker", job], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "a worker failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cell(variants: list[tuple[str, str]], batch: int, threads: int, rounds: int, steps: int, past: int,
         alone: bool = False) -> dict:
    """One (batch, threads) cell: a fresh process per rotation of the load order, or (alone) a fresh
    process per variant and round, the variants' order rotating each round."""
    pooled: dict[str, list[float]] = {name: [] for name, _ in variants}
    by_position: dict[str, list[float]] = {name: [0.0] * len(variants) for name, _ in variants}
    for shift in range(rounds if alone else len(variants)):
        order = variants[shift % len(variants):] + variants[:shift % len(variants)]
        if alone:
            for entry in order:
                pooled[entry[0]] += run_worker([entry], batch, threads, 1, steps, past)[entry[0]]
            continue
        times = run_worker(order, batch, threads, rounds, steps, past)
        for position, (name, _) in enumerate(order):
            pooled[name] += times[name]
            by_position[name][position] = statistics.median(times[name])
        print(f"batch {batch}, {threads} thread(s): load order {', '.join(n for n, _ in order)} done", file=sys.stderr)
    if alone:
        print(f"batch {batch}, {threads} thread(s): {rounds} rounds, each variant alone in a process", file=sys.stderr)
    first = statistics.median(pooled[variants[0][0]])
    return {"batch": batch, "threads": threads, "alone": alone, "variants": {
        name: {"median_ms": statistics.median(pooled[name]), "ratio_to_first": statistics.median(pooled[name]) / first,
               # round by round (the variants' rounds run back to back): drift that spans a round cancels
               "paired_ratio_to_first": statistics.median(
                   a / b for a, b in zip(pooled[name], pooled[variants[0][0]], strict=True)),
               "median_ms_by_load_position": None if alone else by_position[name], "ms": pooled[name]}
        for name, _ in variants}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help="NAME=ARTIFACT:VARIANT or NAME=GENAI_FOLDER, two or more")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=15,
                        help="rounds per load order; with --alone, rounds in all (a process per variant each)")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per round")
    parser.add_argument("--past", type=int, default=45, help="cached tokens before each step")
    parser.add_argument("--alone", action="store_true", help="each variant in a process of its own")
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
        if not equals or (":" not in spec and not is_genai_folder(spec)):
            raise SystemExit(f"error: {text!r} is not NAME=ARTIFACT:VARIANT or NAME=GENAI_FOLDER (a folder with "
                             "genai_config.json), e.g. new=out/a:cpu-int4")
        variants.append((name, spec))
    if len(variants) < 2:
        raise SystemExit("error: name two or more variants to compare, e.g. new=out/a:cpu-int4 old=/tmp/b:cpu-int4")
    for _, spec in variants:  # a bad name or a damaged artifact fails here, before any timing
        load(spec, 1, verify=True).close()
    cells = [cell(variants, batch, threads, args.rounds, args.steps, args.past, args.alone)
             for batch in args.batch for threads in args.threads]
    result = {"past": args.past, "steps": args.steps, "alone": args.alone,
              ("rounds" if args.alone else "rounds_per_order"): args.rounds,
              "variants": dict(variants), "cells": cells}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    names = [name for name, _ in variants]
    print(f"| batch | threads | {' | '.join(f'{n} ms' for n in names)} | "
          f"{' | '.join(f'{n} / {names[0]} (paired)' for n in names[1:])} | by load position (ms, 1st/2nd/...) |")
    print("| ---: | ---: |" + " ---: |" * (2 * len(names) - 1) + " --- |")
    for c in cells:
        v = c["variants"]
        positions = "; ".join(f"{n} " + "/".join(f"{x:.2f}" for x in v[n]["median_ms_by_load_position"])
                              for n in names) if not c["alone"] else "(each alone)"
        medians = " | ".join(f"{v[n]['median_ms']:.2f}" for n in names)
        ratios = " | ".join(f"{v[n]['ratio_to_first']:.3f} ({v[n]['paired_ratio_to_first']:.3f})" for n in names[1:])
        print(f"| {c['batch']} | {c['threads']} | {medians} | {ratios} | {positions} |")


if __name__ == "__main__":
    main()
