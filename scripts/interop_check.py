"""Open Kiln's variant folders, as they are, in Optimum's ORTModelForCausalLM (transformers 4.57, in
its own virtual environment: Optimum needs transformers < 4.58) and check its greedy tokens, alone and
as a left-padded batch, against Kiln's runtime; run each graph under `polygraphy run --onnxrt` with
the shapes `kiln inspect --polygraphy-shapes` prints. Run by scripts/interop-check, which makes that
environment; writes bench/results/interop.json and prints a table.

    python scripts/interop_check.py --interop-python .venv-interop/bin/python [ARTIFACT ...]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The quick brown fox", "A KV cache keeps the keys and values of earlier tokens. Prefill runs",
           "def add(a, b):", "Paris is the capital of"]
NEW_TOKENS = 16


def optimum_side(job: dict) -> dict:
    """Inside the transformers-4.57 environment: tokens from Optimum for each folder of the job."""
    import transformers

    results = {"transformers": transformers.__version__}
    from transformers import AutoTokenizer

    for folder, case in job["folders"].items():
        encoded = [AutoTokenizer.from_pretrained(folder)(p).input_ids for p in PROMPTS]
        try:
            results[folder] = {"encode": encoded, **_optimum_tokens(folder, case)}
        except Exception as exc:  # noqa: BLE001 - one folder's failure is a row of the table, not the end
            results[folder] = {"encode": encoded, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return results


def _optimum_tokens(folder: str, case: dict) -> dict:
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    model = ORTModelForCausalLM.from_pretrained(folder)
    eos, pad = case["eos"], case["pad"]
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    alone = []
    for ids in case["prompt_ids"]:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             **kwargs)
        alone.append(out[0, len(ids):].tolist())
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token_id = pad
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, return_token_type_ids=False)
    out = model.generate(**batch, **kwargs)
    batched = out[:, batch.input_ids.shape[1]:].tolist()
    theta = getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", None)
    return {"alone": alone, "batch": batched, "rope_theta": theta}


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def _tiny_artifacts(root: Path) -> list[Path]:
    sys.path.insert(0, str(ROOT))
    from rich.console import Console

    from compiler.pipeline import compile_recipe
    from compiler.progress import StageLog
    from tests.conftest import FP32_VARIANT, TINY_CONFIGS, UNFUSED_VARIANT, build_tiny_checkpoint, write_recipe

    artifacts = []
    for family in TINY_CONFIGS:
        print(f"compiling a tiny {family}", flush=True)
        checkpoint = build_tiny_checkpoint(family, root / "checkpoints" / family)
        recipe = write_recipe(root / f"{family}.yaml", checkpoint, name=f"tiny-{family}",
                              variants=FP32_VARIANT + UNFUSED_VARIANT)
        artifacts.append(compile_recipe(recipe, root / f"tiny-{family}", log=StageLog(Console(quiet=True))))
    return artifacts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="*", type=Path,
                        help="Artifacts to check [default: every family as a tiny model, and "
                             "out/smollm2-135m-instruct if it is there].")
    parser.add_argument("--interop-python", required=True, help="Python of the environment with Optimum.")
    parser.add_argument("--optimum-side", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "interop.json")
    args = parser.parse_args()
    if args.optimum_side:
        print(json.dumps(optimum_side(json.loads(args.optimum_side.read_text()))))
        return 0

    from runtime.artifact import Artifact
    from runtime.generator import Generator
    from runtime.interop import optimum_problem
    from runtime.sampling import SamplingParams

    work = Path(tempfile.mkdtemp(prefix="kiln-interop-"))
    artifacts = list(args.artifacts)
    if not artifacts:
        artifacts = _tiny_artifacts(work)
        smollm2 = ROOT / "out" / "smollm2-135m-instruct"
        if (smollm2 / "manifest.json").is_file():
            artifacts.append(smollm2)
    job, kiln, rows = {"folders": {}}, {}, []
    for artifact in artifacts:
        opened = Artifact.open(artifact)
        for name, entry in opened.manifest.built().items():
            if entry.target != "onnxruntime" or not entry.sidecars:
                continue
            generator = Generator.load(artifact, name)
            ids = [generator.encode(p) for p in PROMPTS]
            params = SamplingParams(max_new_tokens=NEW_TOKENS)
            # Alone and as one batch: a graph that quantizes activations per tensor answers each differently.
            alone = [generator.generate([i], params)[0].token_ids for i in ids]
            tokens = [r.token_ids for r in generator.generate(ids, params)]
            folder = str(opened.folder / "variants" / name)
            eos = sorted(generator.eos_ids)
            job["folders"][folder] = {"prompt_ids": ids, "eos": eos, "pad": generator.pad_id}
            kiln[folder] = {"label": f"{opened.manifest.name}:{name}", "ids": ids, "tokens": tokens, "eos": eos,
                            "alone": alone,
                            "shared": entry.interface.shared_buffers,
                            "optimum_problem": optimum_problem(opened.manifest.document, name),
                            "rope_theta": (opened.manifest.model.config.get("rope_parameters") or {})
                            .get("rope_theta")}
    job_file = work / "job.json"
    job_file.write_text(json.dumps(job))
    print(f"Optimum on {len(job['folders'])} variant folders", flush=True)
    optimum = subprocess.run([args.interop_python, __file__, "--interop-python", args.interop_python,
                              "--optimum-side", str(job_file)], capture_output=True, text=True)
    if optimum.returncode:
        print(optimum.stderr[-4000:], file=sys.stderr)
        return 1
    theirs = json.loads(optimum.stdout.strip().splitlines()[-1])
    polygraphy = Path(args.interop_python).with_name("polygraphy")
    for folder, mine in kiln.items():
        got = theirs[folder]
        eos = mine["eos"]
        if "error" in got:
            got = {"alone": [], "batch": [], "rope_theta": None, **got}
        sizes = "batch=1,seq=8,past=0" if mine["shared"] else "batch=2,seq=8,past=3"
        shapes = subprocess.run([sys.executable, "-m", "runtime.kiln_cli", "inspect",
                                 f"{Path(folder).parents[1]}:{Path(folder).name}", "--polygraphy-shapes", sizes],
                                capture_output=True, text=True, check=True).stdout
        ran = subprocess.run([str(polygraphy), "run", f"{folder}/model.onnx", "--onnxrt", *shlex.split(shapes)],
                             capture_output=True, text=True)
        rows.append({
            "variant": mine["label"],
            "tokenizer_same_ids": sum(a == b for a, b in zip(got["encode"], mine["ids"], strict=False)),
            "optimum_alone_same_tokens": sum(_until_eos(a, eos) == b for a, b in
                                             zip(got["alone"], mine["alone"], strict=False)),
            "optimum_batch_same_tokens": sum(_until_eos(a, eos) == b for a, b in
                                             zip(got["batch"], mine["tokens"], strict=False)),
            "rope_theta_4x": got["rope_theta"], "rope_theta": mine["rope_theta"],
            "polygraphy": "PASSED" if ran.returncode == 0 and "PASSED" in ran.stdout + ran.stderr else
            (ran.stdout + ran.stderr)[-300:],
            "polygraphy_sizes": sizes,
            "optimum_error": got.get("error"),
            "optimum_problem_predicted": mine["optimum_problem"],
        })
    result = {"transformers_for_optimum": theirs["transformers"], "prompts": len(PROMPTS), "new_tokens": NEW_TOKENS,
              "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    n = len(PROMPTS)
    print("\n| variant folder | tokenizer (4.57) = Kiln | Optimum alone = Kiln alone | Optimum batch = Kiln batch | "
          "polygraphy run --onnxrt |\n| --- | ---: | ---: | ---: | --- |")
    for row in rows:
        if row["optimum_problem_predicted"]:
            optimum = "refused, as `kiln export-for optimum` predicts | |" if row["optimum_error"] else \
                "ran, though predicted not to | |"
        else:
            optimum = f"{row['optimum_alone_same_tokens']}/{n} | {row['optimum_batch_same_tokens']}/{n} |"
        print(f"| {row['variant']} | {row['tokenizer_same_ids']}/{n} | {optimum} {row['polygraphy'][:40]} |")
        if row["optimum_error"] and not row["optimum_problem_predicted"]:
            print(f"  Optimum: {row['optimum_error']}")
    print(f"\n{args.output}")
    good = all(r["polygraphy"] == "PASSED" and (
        bool(r["optimum_error"]) if r["optimum_problem_predicted"] else
        r["tokenizer_same_ids"] == r["optimum_alone_same_tokens"] == r["optimum_batch_same_tokens"] == n)
        for r in rows)
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
