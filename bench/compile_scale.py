"""Compile time and memory against model size: random-weight Llamas saved as real checkpoints are
(sharded bf16 safetensors with an index), compiled by `compile-model` in a fresh process each, one fp32
variant (add --quantized for an int8 and an int4 variant too). Per stage: seconds and the peak
resident set (the stage log's sampler, recorded in the manifest), and each variant's steps; overall:
/usr/bin/time's maximum resident set, and the most disk the compile's files took (sampled every
second) against compile-model's prediction. Then the artifact generates 16 tokens through run-model, as a
user runs it. Writes bench/results/compile_scale.json and prints the tables.

    python bench/compile_scale.py [--sizes 135m,480m] [--quantized]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Llama shapes: 135m is SmolLM2-135M's, 480m the issue's, 1.5b Qwen2.5-1.5B's widths in a Llama.
SIZES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "480m": dict(hidden_size=1280, intermediate_size=4480, num_hidden_layers=20, num_attention_heads=20,
                 num_key_value_heads=4, vocab_size=49152, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
PROMPT = "The capital of France is"
TOKEN_IDS = ("import json, sys\nfrom runtime.generator import Generator\nfrom runtime.sampling import SamplingParams\n"
             "g = Generator.load(sys.argv[1])\n"
             "print(json.dumps(g.generate([g.encode(sys.argv[2])], SamplingParams(max_new_tokens=16))[0].token_ids))")
ACCURACY_KEYS = ("top1_agreement", "greedy_match", "perplexity_change", "max_logit_error")
FP32 = "  - {name: cpu-fp32, target: onnxruntime}\n"
QUANTIZED = ("  - {name: cpu-int8, target: onnxruntime, quantize: {mode: int8-dynamic}}\n"
             "  - {name: cpu-int4, target: onnxruntime, quantize: {mode: int4}}\n")


def build_checkpoint(name: str, folder: Path) -> int:
    """A random Llama of these shapes in bf16 shards; returns its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.conftest import build_tokenizer

    config = LlamaConfig(**SIZES[name], max_position_embeddings=2048, bos_token_id=0, eos_token_id=0,
                         dtype="bfloat16")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="500MB")
    build_tokenizer(folder)
    return sum(p.numel() for p in model.parameters())


def compile_one(name: str, work: Path, quantized: bool) -> dict:
    checkpoint = work / f"llama-{name}"
    started = time.perf_counter()
    parameters = build_checkpoint(name, checkpoint)
    print(f"{name}: {parameters / 1e6:.0f}M parameters, checkpoint written in {time.perf_counter() - started:.0f} s",
          flush=True)
    recipe = work / f"{name}.yaml"
    recipe.write_text(f"name: scale-{name}\nmodel: {{source: \"{checkpoint}\"}}\n"
                      "export: {max_context: 512}\nvariants:\n" + FP32 + (QUANTIZED if quantized else ""))
    out = work / f"artifact-{name}"
    command = ["/usr/bin/time", "-v", str(Path(sys.executable).with_name("compile-model")), str(recipe),
               "--out", str(out)]
    started = time.perf_counter()
    with DiskPeak(work, besides=checkpoint) as disk:
        run = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)
    row = {"size": name, "parameters": parameters, "fp32_weight_bytes": parameters * 4, "quantized": quantized,
           "seconds": round(seconds, 1), "peak_rss_bytes": int(peak.group(1)) * 1024 if peak else None,
           "peak_disk_bytes": disk.peak, "predicted_disk_bytes": predicted_disk(recipe), "exit": run.returncode}
    if run.returncode:
        own = run.stderr.split("\tCommand being timed")[0]  # what compile-model said, before time's report
        row["error"] = [line for line in own.splitlines()
                        if line.strip() and not line.startswith("Command exited")][-12:]
        return row
    manifest = json.loads((out / "manifest.json").read_text())
    # Each variant's steps ("variant cpu-fp32 / quantize") beside the stages, where the peak comes from.
    compiled = manifest["compile"]
    row["stage_seconds"] = {**compiled["stage_seconds"], **compiled.get("step_seconds", {})}
    row["stage_peak_rss_mib"] = {**compiled["stage_peak_rss_mib"], **compiled.get("step_peak_rss_mib", {})}
    # time's maximum is one process's: load, export and the reference run in a child, whose stage peaks
    # in the stage log are counted with what the parent held beside them.
    stages_peak = max(row["stage_peak_rss_mib"].values()) * 2**20
    row["peak_rss_bytes"] = max(row["peak_rss_bytes"] or 0, stages_peak)
    row["peak_over_weights"] = round(row["peak_rss_bytes"] / row["fp32_weight_bytes"], 2)
    row["export_seconds_per_billion"] = round(row["stage_seconds"]["export"] / (parameters / 1e9), 1)
    # No default gates: what the compile measured against eager, so a reader sees the artifact is right.
    row["accuracy"] = {name: {k: entry["accuracy"][k] for k in ACCURACY_KEYS}
                       for name, entry in manifest["variants"].items() if "accuracy" in entry}
    row["generate"] = generate(out)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(checkpoint, ignore_errors=True)
    return row


class DiskPeak:
    """The most bytes the files under `folder` (but not under `besides`) took on disk while the block ran,
    sampled every second: the compile's staging folder, against compile-model's prediction."""

    def __init__(self, folder: Path, besides: Path) -> None:
        self.folder, self.besides, self.peak = folder, besides, 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> DiskPeak:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()

    def _sample(self) -> None:
        while not self.done.wait(1.0):
            used = 0
            for root, _, files in os.walk(self.folder):
                if Path(root).is_relative_to(self.besides):
                    continue
                for file in files:
                    try:
                        used += os.stat(os.path.join(root, file)).st_blocks * 512
                    except FileNotFoundError:  # removed between the listing and the stat
                        pass
            self.peak = max(self.peak, used)


def predicted_disk(recipe: Path) -> int:
    from compiler.load import fp32_weight_bytes, vocab_size
    from compiler.pipeline import predicted_compile_disk
    from compiler.recipe import load_recipe

    loaded, _ = load_recipe(recipe)
    return predicted_compile_disk(fp32_weight_bytes(loaded.model), vocab_size(loaded.model),
                                  loaded.select_variants(()))


def generate(artifact: Path) -> dict:
    """The compiled artifact as a user runs it: run-model, greedy, in a fresh process (no torch); then
    the token ids, as random weights give text the test tokenizer may decode to nothing."""
    command = ["/usr/bin/time", "-v", str(Path(sys.executable).with_name("run-model")), str(artifact),
               "--prompt", PROMPT, "--max-new-tokens", "16"]
    started = time.perf_counter()
    run = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr)
    ids = subprocess.run([sys.executable, "-c", TOKEN_IDS, str(artifact), PROMPT], capture_output=True, text=True,
                         cwd=ROOT)
    return {"exit": run.returncode, "seconds": round(seconds, 1),
            "peak_rss_bytes": int(peak.group(1)) * 1024 if peak else None,
            "output": run.stdout.strip()[-300:] if run.returncode == 0 else run.stderr.strip().splitlines()[-3:],
            "new_token_ids": json.loads(ids.stdout) if ids.returncode == 0 else ids.stderr.strip().splitlines()[-3:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="135m,480m", help=f"Comma-separated, of {', '.join(SIZES)}.")
    parser.add_argument("--quantized", action="store_true", help="Add an int8 and an int4 variant.")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "compile_scale.json")
    args = parser.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        print(f"compile_scale: unknown size {unknown[0]!r}; sizes: {', '.join(SIZES)}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="kiln-scale-"))
    try:
        rows = [compile_one(name, work, args.quantized) for name in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    named = {s for r in rows for s in r.get("stage_peak_rss_mib", {})}
    stages = sorted((s for s in named if " / " not in s),
                    key=lambda s: (not s.startswith(("load", "export", "validate", "reference")), s))
    steps = sorted(s for s in named if " / " in s)  # each variant's steps, where its stage peak comes from
    print("\n| model | params | fp32 weights | compile | peak RSS | peak / weights | export s per 1B | "
          "peak disk / predicted | " + " | ".join(f"{s} peak" for s in stages) + " |")
    print("| --- " * (8 + len(stages)) + "|")
    for r in rows:
        if r["exit"]:
            print(f"| {r['size']} | {r['parameters'] / 1e6:.0f}M | failed (exit {r['exit']}): {r['error'][-1]} |")
            continue
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        print(f"| {r['size']} | {r['parameters'] / 1e6:.0f}M | {gib(r['fp32_weight_bytes'])} | {r['seconds']:.0f} s | "
              f"{gib(r['peak_rss_bytes'])} | {r['peak_over_weights']:.1f}x | {r['export_seconds_per_billion']:.0f} | "
              f"{gib(r['peak_disk_bytes'])} / {gib(r['predicted_disk_bytes'])} | "
              + " | ".join(f"{r['stage_peak_rss_mib'].get(s, 0) / 1024:.2f} GiB" for s in stages) + " |")
    if steps:
        print("\n| model | " + " | ".join(steps) + " |")
        print("| --- " * (1 + len(steps)) + "|")
        for r in rows:
            if not r["exit"]:
                peaks, seconds = r["stage_peak_rss_mib"], r["stage_seconds"]
                print(f"| {r['size']} | " + " | ".join(
                    f"{peaks[s] / 1024:.2f} GiB, {seconds[s]:.0f} s" if s in peaks else "" for s in steps) + " |")
    print("\n| model | run-model (16 new tokens) | its peak RSS | token ids generated "
          "| cpu-fp32 vs eager: top-1, greedy match |\n| --- | --- | ---: | ---: | --- |")
    for r in rows:
        if "generate" in r:
            g, fp32 = r["generate"], r["accuracy"].get("cpu-fp32", {})
            ids = g["new_token_ids"]
            print(f"| {r['size']} | exit {g['exit']}, {g['seconds']:.0f} s | "
                  f"{(g['peak_rss_bytes'] or 0) / 2**30:.2f} GiB | "
                  f"{len(ids) if isinstance(ids, list) and all(isinstance(i, int) for i in ids) else ids} | "
                  f"{fp32.get('top1_agreement', float('nan')):.3f}, {fp32.get('greedy_match', float('nan')):.2f} |")
    print(f"\n{args.output}")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
