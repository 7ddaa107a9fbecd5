"""compile-model's pipeline: recipe -> load -> export -> validate -> variants -> package.

Each stage is a function from one artifact to the next; this module only sequences them, times
them, and makes sure the result appears all at once or not at all.
"""

from __future__ import annotations

import os
import resource
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import OutputError, RecipeError
from .export import OnnxArtifact, export
from .load import Checkpoint, load_checkpoint
from .package import model_facts, staging_folder, write_json, write_manifest, write_tokenizer
from .progress import StageLog
from .recipe import Recipe, Variant, load_recipe
from .validate_export import CASES, validate_export


def compile_recipe(recipe_path: str | Path, out: str | Path | None = None, variant_names: Sequence[str] = (),
                   debug: bool = False, log: StageLog | None = None) -> Path:
    """Build the artifact a recipe describes; returns its folder."""
    log = log or StageLog()
    started = time.perf_counter()
    recipe, _ = load_recipe(recipe_path)
    variants = recipe.select_variants(variant_names)
    for variant in variants:
        _check_buildable(variant)
    _check_gates(recipe)
    final = _output_folder(Path(out) if out is not None else Path("out") / recipe.name)
    with staging_folder(final) as staging:
        with log.stage("load", recipe.model.source):
            checkpoint = load_checkpoint(recipe.model)
        _check_context(recipe, checkpoint)
        with log.stage("export", f"opset {recipe.export.opset}, logits: {recipe.export.logits}"):
            with log.spinner("tracing with torch.export and translating to ONNX"):
                exported = export(checkpoint, recipe.export, staging / ".work" / "export", debug=debug)
            log.note(f"{exported.node_count} nodes, files: {', '.join(exported.files)}")
        with log.stage("validate export", "ONNX Runtime vs eager torch"):
            with log.bar("validation cases", total=len(CASES)) as advance:
                validation = validate_export(checkpoint, exported, on_case=lambda _: advance())
            log.note(
                f"max |logit error| {validation['max_abs_logit_error']:.3g} "
                f"(relative {validation['max_rel_logit_error']:.2g}, tolerance {validation['tolerance_relative']:g})"
            )
        if recipe.validate_.prompts:
            log.note("validate.prompts: the prompt-based comparison is not built yet; the export was checked "
                     "on random inputs only")
        with log.stage("variants", ", ".join(v.name for v in variants)):
            built = {v.name: _build_variant(v, exported, staging, log) for v in variants}
        with log.stage("package"):
            shutil.rmtree(staging / ".work")
            write_tokenizer(checkpoint, staging / "tokenizer")
            write_json(staging / "reports" / "export-validation.json", validation)
            sections = _manifest_sections(recipe, checkpoint, exported, validation, built, log, started)
            write_manifest(staging, sections, log)
    return final


def _output_folder(path: Path) -> Path:
    """The artifact replaces `path` only if `path` is absent or an earlier artifact: never a user's folder."""
    path = path.resolve()
    if path.exists() and not (path / "manifest.json").is_file():
        kind = "folder" if path.is_dir() else "file"
        raise OutputError(f"--out {path}: a {kind} that is not a Kiln artifact is already there; choose a new folder")
    return path


def _check_gates(recipe: Recipe) -> None:
    # Gates are pass/fail promises: accepting them without enforcing them would be a silent override.
    gates = recipe.validate_.gates.model_dump(exclude_none=True)
    if gates:
        raise RecipeError(
            f"validate.gates: {', '.join(gates)} cannot be enforced yet (this version validates the export on "
            "random inputs against eager torch, with a fixed fp32 tolerance); remove validate.gates"
        )


def _check_context(recipe: Recipe, checkpoint: Checkpoint) -> None:
    limit = checkpoint.config.max_position_embeddings
    if recipe.export.max_context > limit:
        raise RecipeError(
            f"export.max_context: {recipe.export.max_context} exceeds the model's "
            f"max_position_embeddings {limit}; use at most {limit}"
        )


# What each (target, precision, quantize mode) needs that this version can build. A variant whose
# stages are missing is refused before any heavy work rather than built wrong.
def _check_buildable(variant: Variant) -> None:
    if variant.target == "tensorrt":
        return  # reported as skipped with its reason; see _build_variant
    mode = variant.quantize.mode if variant.quantize else None
    if (variant.precision, mode) != ("fp32", None):
        raise RecipeError(
            f"variants.{variant.name}: precision {variant.precision}"
            + (f" with quantize mode {mode}" if mode else "")
            + " needs the optimize/quantize stages, which this version of Kiln does not have yet; "
            "build the fp32 variants with --variant"
        )


def _build_variant(variant: Variant, exported: OnnxArtifact, staging: Path, log: StageLog) -> dict[str, Any]:
    entry: dict[str, Any] = {"target": variant.target, "precision": variant.precision,
                             "quantize": variant.quantize.model_dump() if variant.quantize else None}
    if variant.target == "tensorrt":
        reason = "TensorRT engine builds are not implemented in this version of Kiln"
        log.note(f"{variant.name}: skipped: {reason}")
        return {**entry, "status": "skipped", "reason": reason}
    folder = staging / "variants" / variant.name
    folder.mkdir(parents=True)
    for name in exported.files:
        _link_or_copy(exported.folder / name, folder / name)
    files = [f"variants/{variant.name}/{name}" for name in exported.files]
    log.note(f"{variant.name}: the validated fp32 export, unchanged")
    return {**entry, "status": "built", "files": files, "model": files[0], "node_count": exported.node_count,
            "interface": exported.interface}


def _link_or_copy(source: Path, target: Path) -> None:
    # The export folder is deleted before packaging, so a hard link costs no disk and no time.
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _manifest_sections(recipe: Recipe, checkpoint: Checkpoint, exported: OnnxArtifact, validation: dict,
                       built: dict, log: StageLog, started: float) -> dict[str, Any]:
    source = checkpoint.source
    return {
        "name": recipe.name,
        "source": {"spec": source.spec, "kind": source.kind, "path": str(source.path),
                   "sha256": checkpoint.source_sha256},
        "recipe": recipe.model_dump(mode="json", by_alias=True),
        "model": model_facts(checkpoint, recipe.export.max_context),
        "interface": exported.interface,
        "export": {"node_count": exported.node_count, "opset": recipe.export.opset,
                   "validation": {k: v for k, v in validation.items() if k != "cases"}},
        "variants": built,
        "compile": {
            "stage_seconds": dict(log.seconds),
            "seconds": round(time.perf_counter() - started, 2),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        },
    }
