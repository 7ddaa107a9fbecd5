"""Beam search: Kiln's engine against eager transformers, side by side, on the same prompts.

    python bench/beam.py [--artifact out/smollm2-135m-instruct] [--variant cpu-fp32] [--beams 4]
                         [--prompts 16] [--new-tokens 32] [--threads 2] [--rounds 2]

The same --prompts token-id prompts of 30 to 60 tokens (bench/generate.py's), --new-tokens each,
EOS ignored by neither side (beams end as transformers ends them). Each round runs, one after the
other: transformers `generate(num_beams=K, do_sample=False)` (its eager attention, fp32, torch
threads = --threads) one prompt at a time, then all prompts in one left-padded batch; Kiln the same
two ways (all at once: their beams share the batch). Tokens/s counts the returned best beam's tokens, the medians over
rounds; also how many prompts gave the same best beam as transformers. Writes bench/results/beam.json
and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from generate import make_prompts  # noqa: E402


def eager_beams(model, prompts, beams: int, new_tokens: int, eos: list[int], together: bool
                ) -> tuple[float, list[list[int]]]:
    """transformers' generate, one prompt at a time or all in one left-padded batch."""
    import torch

    start, outputs = time.perf_counter(), []
    groups = [prompts] if together else [[p] for p in prompts]
    with torch.no_grad():
        for group in groups:
            width = max(map(len, group))
            ids = torch.tensor([[eos[0]] * (width - len(p)) + p for p in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
            out = model.generate(ids, attention_mask=mask, num_beams=beams, do_sample=False,
                                 max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=eos[0])
            for row in out[:, width:].tolist():
                outputs.append(row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))])
    return time.perf_counter() - start, outputs


def kiln_beams(generator, prompts, params, together: bool) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    if together:
        results = generator.generate(prompts, params)
    else:
        results = [generator.generate([p], params)[0] for p in prompts]
    return time.perf_counter() - start, [r.token_ids for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, default=ROOT / "out" / "smollm2-135m-instruct")
    parser.add_argument("--variant", default="cpu-fp32")
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "beam.json")
    args = parser.parse_args()

    import torch

    from compiler.load import load_checkpoint
    from compiler.recipe import ModelSpec
    from runtime.generator import Generator
    from runtime.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    generator = Generator.load(args.artifact, args.variant, threads=args.threads, max_batch_size=64)
    source = generator.artifact.manifest.document["source"]["spec"]
    model = load_checkpoint(ModelSpec(source=source)).model
    model.set_attn_implementation("eager")  # transformers' own attention, as compare-model's reference
    eos = sorted(generator.eos_ids)
    prompts = make_prompts(generator.tokenizer, args.prompts)
    params = SamplingParams(max_new_tokens=args.new_tokens, num_beams=args.beams)
    generator.warmup()
    runs: dict[str, list[float]] = {"transformers eager, one prompt at a time": [],
                                    "transformers eager, all prompts in one batch": [],
                                    "kiln, one prompt at a time": [], "kiln, all prompts in one batch": []}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.rounds):
        for name in runs:
            if name.startswith("transformers"):
                seconds, tokens = eager_beams(model, prompts, args.beams, args.new_tokens, eos, "all" in name)
            else:
                seconds, tokens = kiln_beams(generator, prompts, params, together="all" in name)
            runs[name].append(sum(map(len, tokens)) / seconds)
            outputs[name] = tokens
            print(f"{name:42} {runs[name][-1]:8.1f} tok/s", flush=True)
    reference = outputs["transformers eager, one prompt at a time"]
    eager_rate = statistics.median(runs["transformers eager, one prompt at a time"])
    rows = [{"run": name, "tokens_per_s": statistics.median(rates), "rounds": rates,
             "vs_eager": statistics.median(rates) / eager_rate,
             "same_best_beam": sum(a == b for a, b in zip(outputs[name], reference, strict=True))}
            for name, rates in runs.items()]
    args.output.write_text(json.dumps({"artifact": str(args.artifact), "variant": args.variant, "beams": args.beams,
                                       "prompts": args.prompts, "new_tokens": args.new_tokens,
                                       "threads": args.threads, "rows": rows}, indent=2) + "\n")
    print(f"\nbeam {args.beams}, {args.prompts} prompts x {args.new_tokens} tokens, {args.threads} threads, "
          f"medians of {args.rounds} rounds")
    print("| run | tokens/s | vs eager | best beam = eager |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['run']} | {row['tokens_per_s']:.1f} | {row['vs_eager']:.2f} | "
              f"{row['same_best_beam']}/{args.prompts} |")


if __name__ == "__main__":
    main()
