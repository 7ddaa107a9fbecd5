"""compile-model's pipeline: recipe -> load -> eager reference (prompts, text) -> export (and eager
on its cases; these three in a process of their own, the only one that imports torch) -> validate
export -> per variant (the named steps of compiler/variant_build.py: optimize -> [exclude: auto's
sensitivity search] -> quantize -> pack -> rotary -> kernels' graph -> A/B against eager + gates,
reports/<variant>.* -> files -> manifest entry -> memory -> [engine]) -> package.

Each stage is a function from one artifact to the next; this module only sequences them, times
them, and makes sure the result appears all at once or not at all.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import resource
import shutil
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.backends.registry import Target
from runtime.memory import free_host_memory

from .accuracy import Run, reference_run
from .compare import Side, eager_side, read_inputs
from .errors import CompileProcessError, GateFailure, InsufficientDisk, InsufficientMemory, OutputError, RecipeError
from .export import export
from .graph import OnnxArtifact
from .load import Checkpoint, attention_for_export, fp32_weight_bytes, load_checkpoint, preflight, vocab_size
from .package import (
    model_facts,
    remove_stale_staging,
    staging_folder,
    write_json,
    write_manifest,
    write_sidecars,
    write_tokenizer,
)
from .progress import StageLog, c_library_function, current_rss
from .recipe import (
    DEFAULT_CALIBRATION,
    DEFAULT_MAX_CONTEXT,
    DEFAULT_PROMPTS,
    DEFAULT_TEXT,
    Recipe,
    Variant,
    load_recipe,
    read_prompts,
    resolve_path,
    with_max_context,
)
from .tensorrt_build import EngineUnavailable
from .validate_export import CASES, EagerCase, eager_cases, validate_export
from .variant_build import ValidationData, build_variant, describe

# A compile's peak resident memory against the model's fp32 weights: an upper bound over
# bench/compile_scale.py's random Llamas (docs/compiling.md, "Compile time and memory"), which fit 0.4 GiB plus
# 1.12x the weights (135M 0.97, 480M 2.31, 1.5B 6.83 GiB). The peak is ONNX Runtime's: the fp32
# variant's accuracy step or its optimize check (a session with its pre-packed weights); the torch
# stages, in their own process (on bf16 weights as stored below HOLD_NARROW_BELOW_BYTES), stay under it. A quantized
# variant's quantize step holds the fp32 graph and its quantized weights at once (135M: +0.42x; 480M,
# measured before the last changes: +0.7x).
COMPILE_BASE_BYTES = int(0.6 * 2**30)
COMPILE_PEAK_PER_WEIGHT_BYTE = 1.2
QUANTIZED_VARIANT_PER_WEIGHT_BYTE = 0.8
# Holding bf16/fp16 weights as stored and widening each module's per call halves the torch stages'
# weights but costs the eager reference time (1.4x to 1.7x at 135M, measured interleaved in one
# process). It lowers the compile's peak only where the torch stages set it, below about 3 GiB of
# fp32 weights (at 480M an fp32 reference peaked at 2.42 GiB against the variant's 2.31). Above it
# ONNX Runtime's stages peak higher than an fp32 reference does (1.5B: 6.55 GiB against 6.83), so the
# weights are widened once, at load.
HOLD_NARROW_BELOW_BYTES = 3 * 2**30


def predicted_compile_peak(weight_bytes: int, quantized_variants: int) -> int:
    factor = COMPILE_PEAK_PER_WEIGHT_BYTE + (QUANTIZED_VARIANT_PER_WEIGHT_BYTE if quantized_variants else 0)
    return int(COMPILE_BASE_BYTES + factor * weight_bytes)


def check_compile_memory(recipe: Recipe, variants: Sequence[Variant]) -> tuple[int, int] | None:
    """Refuse, before loading anything, a compile whose predicted peak is over the memory this host has
    free (it would be killed by the OOM killer halfway, after minutes). Returns the prediction and the
    free memory (None where the weights cannot be known from a config: GGUF files)."""
    weights = fp32_weight_bytes(recipe.model)
    if weights is None:
        return None
    needed = predicted_compile_peak(weights, sum(1 for v in variants if v.quantize))
    free = free_host_memory()
    if needed > free:
        raise InsufficientMemory(
            f"this compile needs about {needed / 2**30:.1f} GiB (the model's fp32 weights are "
            f"{weights / 2**30:.1f} GiB) and this host has {free / 2**30:.1f} GiB free; free memory, compile on "
            "a larger machine, or pass --no-memory-check to try anyway")
    return needed, free


# A compile's disk use under the output folder, against the model's fp32 weights. The export holds its
# weights twice while it saves them (the scratch file it traced from, and model.onnx.data); then its
# graph stays until the end, each finished variant's graph stays (at most the weights' size: a
# quantized variant keeps its embedding table in fp32), and the variant being built holds the graph it
# reads and the one it writes (a third during exclude: auto's search: the quantized attempt and its
# packed copy beside the optimized graph; an engine beside its graph). Besides the graphs: logits, a
# row of the vocabulary in fp32 for each position of the validation data (1,551 with the default
# prompts and text: 0.94 GB at a vocabulary of 151,936), the eager reference's and the variant's being
# measured; the tokenizer and the reports.
COMPILE_DISK_BASE_BYTES = 2**28
LOGIT_ROWS_ON_DISK = 2 * 2000


def predicted_compile_disk(weight_bytes: int, vocab: int, variants: Sequence[Variant]) -> int:
    graphs = 2  # the export, saving
    for built, variant in enumerate(variants):
        held = 3 if variant.quantize and variant.quantize.exclude == "auto" else 2
        graphs = max(graphs, 1 + built + held + (variant.target == Target.TENSORRT))
    return int(COMPILE_DISK_BASE_BYTES + LOGIT_ROWS_ON_DISK * vocab * 4 + graphs * weight_bytes)


def check_compile_disk(recipe: Recipe, variants: Sequence[Variant], final: Path) -> tuple[int, int] | None:
    """Refuse, before loading anything, a compile whose predicted disk use is over what the output
    folder's file system has free (it would stop on a full disk after minutes, and fill the disk for
    everything else on the host meanwhile). Returns the prediction and the free bytes (None for GGUF)."""
    weights = fp32_weight_bytes(recipe.model)
    if weights is None:
        return None
    needed = predicted_compile_disk(weights, vocab_size(recipe.model) or 0, variants)
    existing = next(p for p in (final, *final.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if needed > free:
        raise InsufficientDisk(
            f"this compile writes about {needed / 2**30:.1f} GiB under {existing} (the model's fp32 weights are "
            f"{weights / 2**30:.1f} GiB: the export's graph, each variant's, and the one being built) and that "
            f"file system has {free / 2**30:.1f} GiB free; free space, pass --out on a larger disk, or pass "
            "--no-disk-check to try anyway")
    return needed, free


def compile_recipe(recipe_path: str | Path, out: str | Path | None = None, variant_names: Sequence[str] = (),
                   debug: bool = False, keep_failed: bool = False, strict: bool = False,
                   log: StageLog | None = None, memory_check: bool = True, disk_check: bool = True) -> Path:
    """Build the artifact a recipe describes; returns its folder."""
    log = log or StageLog()
    started = time.perf_counter()
    recipe, base = load_recipe(recipe_path)
    variants = recipe.select_variants(variant_names)
    limit = preflight(recipe.model, recipe.export.max_context)
    asked = recipe.export.max_context
    if asked is None:
        recipe = with_max_context(recipe, min(DEFAULT_MAX_CONTEXT, limit or DEFAULT_MAX_CONTEXT), str(recipe_path))
        variants = recipe.select_variants(variant_names)
    memory = check_compile_memory(recipe, variants) if memory_check else None
    if memory is not None:
        log.note(f"predicted peak memory {memory[0] / 2**30:.1f} GiB, {memory[1] / 2**30:.1f} GiB free")
    final = _output_folder(Path(out) if out is not None else Path("out") / recipe.name)
    for stale in remove_stale_staging(final):
        log.note(f"removed {stale}, left by a compile that was killed")
    # After the stale folders go: a killed compile of a large model may have left most of the disk it needs.
    disk = check_compile_disk(recipe, variants, final) if disk_check else None
    if disk is not None:
        log.note(f"predicted disk use {disk[0] / 2**30:.1f} GiB, {disk[1] / 2**30:.1f} GiB free")
    with staging_folder(final) as staging:
        # Load, the eager reference and export run in a process of their own: this one never imports
        # torch, and torch's libraries and whatever its stages leave behind go back to the OS before
        # ONNX Runtime loads a graph.
        stages = in_child_process(_eager_stages, recipe, str(recipe_path), asked, base, staging, debug,
                                  logging.getLogger().level, log.console.quiet)
        log.merge(stages.log, beside=current_rss())
        recipe, exported, data, reference = stages.recipe, stages.exported, stages.data, stages.reference
        variants = recipe.select_variants(variant_names)
        eager = _torch_free_side(stages.side, staging / "tokenizer")
        with log.stage("validate export", "ONNX Runtime vs eager torch"):
            with log.bar("validation cases", total=len(CASES)) as advance:
                validation = validate_export(stages.cases, exported, on_case=lambda _: advance())
            log.note(
                f"max |logit error| {validation['max_abs_logit_error']:.3g} "
                f"(relative {validation['max_rel_logit_error']:.2g}, tolerance {validation['tolerance_relative']:g})"
            )
        built = {}
        for variant in variants:
            with log.stage(f"variant {variant.name}", describe(variant)):
                built[variant.name] = build_variant(variant, exported, staging, data, eager, reference, recipe,
                                                    base, log)
        skipped = {n: v["reason"] for n, v in built.items() if v["status"] == "skipped"}
        if skipped and strict:
            lines = "; ".join(f"{n}: {reason}" for n, reason in skipped.items())
            raise EngineUnavailable(f"--strict: engines not built: {lines}")
        if any(v["status"] == "failed" for v in built.values()) and not keep_failed:
            raise GateFailure(gate_failure(built))
        with log.stage("package"):
            shutil.rmtree(staging / ".work")
            write_json(staging / "reports" / "export-validation.json", validation)
            sections = _manifest_sections(recipe, stages.source, stages.model, exported, validation, built, log,
                                          started)
            write_sidecars(staging, sections)
            write_manifest(staging, sections, log)
    return final


@dataclass
class EagerStages:
    """What load, export and the eager reference leave for the stages after them: files in the staging
    folder and small records (the reference's logits are on disk, read a row at a time)."""

    recipe: Recipe  # with max_context checked against the loaded config
    exported: OnnxArtifact
    cases: list[EagerCase]
    data: ValidationData
    reference: Run
    model: dict[str, Any]
    source: dict[str, Any]
    side: Side  # the eager side without its backend, encode and decode
    log: dict[str, dict[str, float]]  # the stages' seconds and peaks (StageLog.records)


def _eager_stages(recipe: Recipe, recipe_path: str, asked: int | None, base: Path, staging: Path, debug: bool,
                  logging_level: int, quiet: bool) -> EagerStages:
    """load -> eager reference (and eager on the export's validation cases) -> export, in the process
    in_child_process starts; its stage lines as quiet as the caller's."""
    logging.basicConfig(level=logging_level)
    log = StageLog(quiet=quiet)
    with log.stage("load", recipe.model.source):
        checkpoint = load_checkpoint(recipe.model, keep_narrow_weights=_hold_narrow(recipe.model))
    recipe = _check_context(recipe, checkpoint, asked, recipe_path)
    # Everything eager before the export: the export is the model's last use (it traces the model with
    # its weights moved out), and it leaves about 0.2 GiB behind that nothing frees (measured at 135M:
    # none of it in tensors, arrays or onnxscript's globals), which the reference would stand on.
    with log.stage("reference", "eager torch on the validation prompts and held-out text"):
        eager = eager_side(checkpoint, f"eager:{recipe.model.source}", device="cpu")
        data = _validation_data(recipe, base, eager)
        reference = reference_run(eager.backend, data.inputs, into=staging / ".work" / "reference")
        model = model_facts(checkpoint, recipe.export.max_context)
        source = _source_section(checkpoint)
        write_tokenizer(checkpoint, staging / "tokenizer")
        cases = eager_cases(checkpoint, recipe.export.logits)  # eager torch on the export's validation cases
    checkpoint.model.set_attn_implementation(attention_for_export(checkpoint.family))  # as load set it
    with log.stage("export", f"opset {recipe.export.opset}, logits: {recipe.export.logits}"):
        with log.spinner("tracing with torch.export and translating to ONNX"):
            exported = export(checkpoint, recipe.export, staging / ".work" / "export", debug=debug)
        log.note(f"{exported.node_count} nodes, files: {', '.join(exported.files)}")
    side = dataclasses.replace(eager, backend=None, encode=None, decode=None)  # torch and transformers stay here
    return EagerStages(recipe, exported, cases, data, reference, model, source, side, log.records())


def _hold_narrow(spec: Any) -> bool:
    """Whether the compile holds a bf16/fp16 checkpoint's weights as stored, widened per call
    (load_checkpoint's keep_narrow_weights): only where that lowers the compile's peak."""
    weights = fp32_weight_bytes(spec)
    return weights is None or weights < HOLD_NARROW_BELOW_BYTES


def _torch_free_side(side: Side, tokenizer_folder: Path) -> Side:
    """The eager side as the later stages use it (names for reports, text from token ids), with the
    artifact's own tokenizer in place of transformers'."""
    from runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(tokenizer_folder)
    return dataclasses.replace(side, encode=tokenizer.encode, decode=tokenizer.decode)


def in_child_process(function: Callable[..., Any], *args: Any) -> Any:
    """function(*args) in a fresh process (spawned: nothing of this one's memory is copied), its result
    or its exception brought back; the process is gone when this returns."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child_main, args=(send, function, args, os.getpid()),
                            name="kiln-compile-eager", daemon=True)
    child.start()
    send.close()
    try:
        try:
            status, value = pickle.loads(receive.recv_bytes())
        except EOFError:
            child.join()
            killed = " (killed: most likely out of memory)" if child.exitcode == -signal.SIGKILL else ""
            raise CompileProcessError(f"the load / export / reference process ended with exit code "
                                      f"{child.exitcode}{killed} before it finished") from None
    finally:
        if child.is_alive():  # interrupted, or an error here: never leave it running
            child.terminate()
        child.join()
    if status == "error":
        raise value
    return value


def gate_failure(built: dict[str, dict[str, Any]]) -> str:
    """The one line for variants that missed their gates: each one's misses, and where its graph for Kiln's
    CPU kernels passed them, how to ship it for hosts that run those kernels."""
    lines = "; ".join(f"{name}: {', '.join(entry['failed_gates'])}" + (
        " (its graph for Kiln's CPU kernels passes them: `cpu_kernels: required` ships it for hosts that run "
        "those kernels)" if "kernel_accuracy" in entry and "cpu_kernels" not in entry else "")
        for name, entry in built.items() if entry["status"] == "failed")
    return f"accuracy gates missed: {lines} (compile with --keep-failed to keep and inspect them)"


def _child_main(send: Any, function: Callable[..., Any], args: tuple, parent: int) -> None:
    import threading

    from tqdm import tqdm

    _die_with_parent(parent)
    # transformers' progress bars (tqdm) would make a multiprocessing lock: a named semaphore that the
    # resource tracker this process shares with its parent reports as leaked when the parent exits.
    tqdm.set_lock(threading.RLock())
    try:
        result = ("ok", function(*args))
    except BaseException as exc:  # noqa: BLE001 (every exception goes back to the parent, which raises it)
        # The traceback stays in this process: as a note, it is what --debug shows (the CLI's one line
        # is the message alone).
        exc.add_note("in the load / export / reference process:\n" + "".join(traceback.format_exception(exc)))
        result = ("error", exc)
    try:  # what the parent cannot rebuild (an exception whose __init__ takes other arguments) fails here
        payload = pickle.dumps(result)
        pickle.loads(payload)
    except Exception as exc:  # noqa: BLE001
        what = f"{type(result[1]).__name__}: {result[1]}" if result[0] == "error" else "its result"
        error = CompileProcessError(f"the load / export / reference process could not hand back {what} ({exc})")
        error.add_note("".join(traceback.format_exception(result[1])) if result[0] == "error" else "")
        payload = pickle.dumps(("error", error))
    send.send_bytes(payload)


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when its parent dies, whatever kills the parent (SIGKILL,
    the OOM killer), so no orphan goes on loading and exporting into a staging folder nobody owns."""
    prctl = c_library_function("prctl")
    if prctl is not None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the call
        os._exit(1)


def _output_folder(path: Path) -> Path:
    """The artifact replaces `path` only if `path` is absent or an earlier artifact: never a user's folder."""
    path = path.resolve()
    if path.exists() and not (path / "manifest.json").is_file():
        kind = "folder" if path.is_dir() else "file"
        raise OutputError(f"--out {path}: a {kind} that is not a Kiln artifact is already there; choose a new folder")
    return path


def _check_context(recipe: Recipe, checkpoint: Checkpoint, asked: int | None, where: str) -> Recipe:
    """The recipe's max_context against the loaded config's limit (which the preflight may not have
    known): an error if the recipe asked for more, else the default lowered to the limit."""
    limit = checkpoint.config.max_position_embeddings
    if asked is None and recipe.export.max_context > limit:
        return with_max_context(recipe, limit, where)
    if recipe.export.max_context > limit:
        raise RecipeError(
            f"export.max_context: {recipe.export.max_context} exceeds the model's "
            f"max_position_embeddings {limit}; use at most {limit}"
        )
    return recipe


def _validation_data(recipe: Recipe, base: Path, eager: Side) -> ValidationData:
    """compare-model's inputs from the recipe's files, tokenized by the checkpoint's tokenizer."""
    prompts_file = resolve_path(base, recipe.validate_.prompts) if recipe.validate_.prompts else DEFAULT_PROMPTS
    text_file = resolve_path(base, recipe.validate_.text) if recipe.validate_.text else DEFAULT_TEXT
    inputs, texts = read_inputs(eager, prompts_file, text_file, recipe.validate_.max_new_tokens,
                                recipe.export.max_context)
    encoded: dict[Path, list[list[int]]] = {}  # each file once, however many variants name it
    calibration = {}
    for variant in recipe.variants:
        named = variant.quantize.calibration if variant.quantize else None
        file = resolve_path(base, named) if named else DEFAULT_CALIBRATION
        if file not in encoded:
            encoded[file] = [eager.encode(p)[: recipe.export.max_context] for p in read_prompts(file)]
        calibration[variant.name] = encoded[file]
    return ValidationData(inputs, texts, calibration)


def _source_section(checkpoint: Checkpoint) -> dict[str, Any]:
    source = checkpoint.source
    return {"spec": source.spec, "kind": source.kind, "path": str(source.path), "sha256": checkpoint.source_sha256}


def _manifest_sections(recipe: Recipe, source: dict[str, Any], model: dict[str, Any], exported: OnnxArtifact,
                       validation: dict, built: dict, log: StageLog, started: float) -> dict[str, Any]:
    return {
        "name": recipe.name,
        "source": source,
        "recipe": recipe.model_dump(mode="json", by_alias=True),
        "model": model,
        "interface": exported.interface,
        "export": {"node_count": exported.node_count, "opset": recipe.export.opset,
                   "validation": {k: v for k, v in validation.items() if k != "cases"}},
        "variants": built,
        "compile": {
            "stage_seconds": dict(log.seconds),
            "stage_peak_rss_mib": {name: round(peak / 2**20) for name, peak in log.peak_rss.items()},
            "step_seconds": dict(log.step_seconds),
            "step_peak_rss_mib": {name: round(peak / 2**20) for name, peak in log.step_peak_rss.items()},
            "seconds": round(time.perf_counter() - started, 2),
            # ru_maxrss and the sampled /proc reads both come from the kernel's approximate per-CPU RSS
            # counters, so a stage's sampled peak can top ru_maxrss by a few MiB: the whole compile's
            # peak is the higher of the two
            "peak_rss_mib": round(max([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                                       *log.peak_rss.values(), *log.step_peak_rss.values()]) / 2**20),
        },
    }
