"""`exclude: auto`'s choice against the shortest passing prefix it starts from, side by side in one run.

    python bench/exclude_auto.py [--artifact out/smollm2-135m-instruct] [--variant cpu-int8]
                                 [--work /tmp/kiln-exclude-auto] [--rounds 3] [--threads 2]

The search (compiler/sensitivity.py) keeps the shortest prefix of the KL ranking that meets the gates,
then drops each of its groups, heaviest first, that the gates pass without. This builds the variant
with that prefix kept (what the search kept before it dropped anything; once, in --work, from the
artifact's own recipe and report) and times it against the artifact's variant: tokens/s of whole
generate calls, prefill included, bench/peers.py's chat prompts and protocol (batch 1 over 16
prompts, 8 and 32 over 64, 32 new tokens), interleaved in --rounds rounds, medians. Accuracy is the
compile's own (the gates' text and prompts). Writes bench/results/exclude_auto.json, prints a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peers import ALONE_PROMPTS, BATCHES, PROMPTS, Kiln, chat_prompts, timed_cell  # noqa: E402


def prefix_variant(artifact: Path, variant: str, work: Path) -> tuple[Path, dict]:
    """The artifact's variant rebuilt with the search's shortest passing prefix kept in fp32 (once, in
    `work`, stamped with what it was built from), and that attempt."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    report = json.loads((artifact / manifest["variants"][variant]["report"]).read_text())
    found = report["exclude_auto"]
    if found["met_gates"] and not found["sensitivity"]:
        sys.exit(f"exclude_auto.py: {variant} in {artifact} met its gates with everything quantized, so the search "
                 "kept nothing in fp32 and ranked nothing: there is no prefix to compare against")
    modules = {r["group"]: r["modules"] for r in found["sensitivity"]}
    ranked = [r["group"] for r in found["sensitivity"]]
    prefixes = [a for a in found["attempts"] if not a["failed_gates"] and a.get("groups") == ranked[:len(a["groups"])]]
    if not found["met_gates"] or not prefixes:
        sys.exit(f"exclude_auto.py: {variant}'s search in {artifact} has no passing prefix to compare against "
                 "(it missed its gates, or the artifact predates the search's drop step): recompile it")
    prefix = min(prefixes, key=lambda a: len(a["groups"]))
    out, stamp = work / "prefix", {"artifact": str(artifact.resolve()), "variant": variant, "groups": prefix["groups"]}
    built = (out / "manifest.json").exists() and (work / "stamp.json").exists()
    if not built or json.loads((work / "stamp.json").read_text()) != stamp:
        import yaml

        shutil.rmtree(out, ignore_errors=True)
        recipe = manifest["recipe"]  # data paths: the main recipe's, relative to recipes/
        for key in ("prompts", "text"):
            if recipe["validate"].get(key):
                recipe["validate"][key] = str(ROOT / "recipes" / recipe["validate"][key])
        entry = next(v for v in recipe["variants"] if v["name"] == variant)
        if entry["quantize"].get("calibration"):
            entry["quantize"]["calibration"] = str(ROOT / "recipes" / entry["quantize"]["calibration"])
        entry["quantize"]["exclude"] = [m for g in prefix["groups"] for m in modules[g]]
        recipe["variants"] = [entry]
        work.mkdir(parents=True, exist_ok=True)
        (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
        print(f"compiling {variant} with the prefix of {len(prefix['groups'])} groups kept", file=sys.stderr)
        subprocess.run([sys.executable, "-c", "from compiler.cli import main; main()", str(work / "recipe.yaml"),
                        "--out", str(out), "--keep-failed"], check=True, cwd=ROOT)
        (work / "stamp.json").write_text(json.dumps(stamp))
    return out, prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default=str(ROOT / "out" / "smollm2-135m-instruct"))
    parser.add_argument("--variant", default="cpu-int8")
    parser.add_argument("--work", default="/tmp/kiln-exclude-auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "exclude_auto.json"))
    args = parser.parse_args()
    artifact = Path(args.artifact)
    prefix_artifact, prefix = prefix_variant(artifact, args.variant, Path(args.work))
    found = json.loads((artifact / "manifest.json").read_text())["variants"][args.variant]
    chosen = json.loads((artifact / found["report"]).read_text())["exclude_auto"]
    built = json.loads((prefix_artifact / "manifest.json").read_text())["variants"][args.variant]
    rows = [{"label": "shortest passing prefix", "groups": prefix["groups"],
             "weights_kept": prefix["weights_kept"], "accuracy": built["accuracy"],
             "backend": Kiln(prefix_artifact, args.variant, args.threads, "prefix")},
            {"label": "exclude: auto (prefix, less what passes without)", "groups": chosen["groups_kept"],
             "weights_kept": chosen["weights_kept"], "accuracy": found["accuracy"],
             "backend": Kiln(artifact, args.variant, args.threads, "auto")}]
    prompts = chat_prompts(rows[0]["backend"].generator, PROMPTS)
    for row in rows:
        row["backend"].generate(prompts[:2], 4)  # warm-up, untimed
        row["runs"] = {batch: [] for batch in BATCHES}
    for number in range(args.rounds):
        for row in rows:
            for batch in BATCHES:
                chosen_prompts = prompts[:ALONE_PROMPTS] if batch == 1 else prompts
                cell = timed_cell(row["backend"], chosen_prompts, batch, args.new_tokens)
                row["runs"][batch].append(len(chosen_prompts) * args.new_tokens / cell["seconds"])
        print(f"round {number + 1} done", file=sys.stderr)
    results = []
    for row in rows:
        row.pop("backend")
        medians = {f"b{batch}_tokens_per_s": statistics.median(runs) for batch, runs in row.pop("runs").items()}
        results.append({**row, **medians, "top1_agreement": row["accuracy"]["top1_agreement"],
                        "perplexity_change": row["accuracy"]["perplexity_change"]})
    for key in [f"b{batch}_tokens_per_s" for batch in BATCHES]:
        results[1][f"{key}_ratio"] = results[1][key] / results[0][key]
    Path(args.output).write_text(json.dumps({"artifact": str(artifact), "variant": args.variant,
                                             "rounds": args.rounds, "threads": args.threads,
                                             "rows": results}, indent=1) + "\n")
    print("| kept in fp32 | groups | MatMul weights in fp32 | b1 tok/s | b8 | b32 | top-1 | ppl change |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['label']} | {len(r['groups'])} | {r['weights_kept']:.1%} | {r['b1_tokens_per_s']:.1f} | "
              f"{r['b8_tokens_per_s']:.1f} | {r['b32_tokens_per_s']:.1f} | {r['top1_agreement']:.3f} | "
              f"{r['perplexity_change']:+.2%} |")
    print("ratio " + " / ".join(f"{results[1][f'b{b}_tokens_per_s_ratio']:.2f}" for b in BATCHES) + " (b1/b8/b32)")


if __name__ == "__main__":
    main()
