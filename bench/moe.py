"""Mixture of experts: a decode step with ONNX Runtime's fused MoE op against the same experts run
densely (every expert over every token, standard ONNX ops: `export.experts: dense`), side by side.

    python bench/moe.py [--experts 8] [--top-k 2] [--hidden 256] [--layers 4] [--threads 2]
                        [--rounds 5] [--steps 40] [--past 64]

A random-weight Mixtral of those shapes (intermediate size 2 x hidden) is compiled twice: with the op
(cpu-fp32, and cpu-int8 and cpu-int4, whose experts are QMoE) and dense (cpu-fp32). Each round times
--steps decode steps of each at batch 1 and 8 over a --past-slot cache, in turn. Medians over rounds.
Writes bench/results/moe.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(folder: Path, args: argparse.Namespace) -> int:
    import torch
    import transformers

    from tests.conftest import EOS, VOCAB, build_tokenizer

    config = transformers.MixtralConfig(
        vocab_size=VOCAB, bos_token_id=EOS, eos_token_id=EOS, hidden_size=args.hidden,
        intermediate_size=2 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256), num_local_experts=args.experts,
        num_experts_per_tok=args.top_k, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return sum(p.numel() for p in model.parameters())


QUANTIZED = ("  - {name: cpu-int8, target: onnxruntime, quantize: {mode: int8-dynamic}}\n"
             "  - {name: cpu-int4, target: onnxruntime, quantize: {mode: int4}}\n")


def compile_form(checkpoint: Path, form: str, work: Path) -> Path:
    from compiler.pipeline import compile_recipe

    recipe = work / f"{form}.yaml"
    recipe.write_text(f'name: moe-{form}\nmodel: {{source: "{checkpoint}"}}\n'
                      f"export: {{opset: 18, max_context: 512, logits: last, experts: {form}}}\n"
                      "variants:\n  - {name: cpu-fp32, target: onnxruntime}\n" + (QUANTIZED if form == "moe" else ""))
    return compile_recipe(recipe, work / f"moe-{form}")


def step_times(artifacts: dict[str, tuple[Path, str]], batch: int, args: argparse.Namespace
               ) -> dict[str, list[float]]:
    """Each round: --steps decode steps of each (artifact, variant) (after 3 untimed), in turn, the order
    rotating by one each round; ms a step."""
    import numpy as np

    from runtime.model import open_model

    feeds = {}
    for form, (artifact, variant) in artifacts.items():
        backend = open_model(artifact, variant, threads=args.threads).backend
        cache = backend.new_cache(batch, args.past + 1 + 3 + args.steps * args.rounds)
        feeds[form] = (backend, np.full((batch, 1), 42, np.int64), np.ones((batch, args.past + 1), np.int64),
                       np.full((batch, 1), args.past, np.int64), cache)
    times: dict[str, list[float]] = {form: [] for form in artifacts}
    forms = list(artifacts)
    for number in range(args.rounds):
        shift = number % len(forms)
        for form in forms[shift:] + forms[:shift]:
            backend, token, mask, position, cache = feeds[form]
            for _ in range(3):
                backend.run(token, mask, position, cache)
            start = time.perf_counter()
            for _ in range(args.steps):
                backend.run(token, mask, position, cache)
            times[form].append((time.perf_counter() - start) / args.steps * 1e3)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--past", type=int, default=64)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "moe.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        parameters = build(work / "checkpoint", args)
        print(f"Mixtral, {args.layers} layers, hidden {args.hidden}, {args.experts} experts, top-{args.top_k}: "
              f"{parameters / 1e6:.1f}M parameters", flush=True)
        fused, dense = (compile_form(work / "checkpoint", form, work) for form in ("moe", "dense"))
        artifacts = {"moe": (fused, "cpu-fp32"), "dense": (dense, "cpu-fp32"), "qmoe_int8": (fused, "cpu-int8"),
                     "qmoe_int4": (fused, "cpu-int4")}
        rows = []
        for batch in (1, 8):
            times = step_times(artifacts, batch, args)
            medians = {form: statistics.median(values) for form, values in times.items()}
            rows.append({"batch": batch, **{f"{form}_ms": median for form, median in medians.items()},
                         "dense_over_moe": medians["dense"] / medians["moe"], "rounds_ms": times})
    result = {"model": {"family": "mixtral", "layers": args.layers, "hidden": args.hidden, "experts": args.experts,
                        "top_k": args.top_k, "parameters": parameters},
              "threads": args.threads, "past": args.past, "steps": args.steps, "rounds": args.rounds, "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ndecode step, {args.threads} threads, {args.past} slots of context (medians of {args.rounds} rounds)")
    print(f"{'batch':>5}  {'MoE op':>9}  {'dense':>9}  {'dense / MoE op':>14}  {'QMoE int8':>9}  {'QMoE int4':>9}")
    for row in rows:
        print(f"{row['batch']:>5}  {row['moe_ms']:7.2f}ms  {row['dense_ms']:7.2f}ms  {row['dense_over_moe']:13.2f}x  "
              f"{row['qmoe_int8_ms']:7.2f}ms  {row['qmoe_int4_ms']:7.2f}ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
