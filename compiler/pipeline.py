"""compile-model's pipeline: recipe -> load -> eager reference (prompts, text) -> export (and eager
on its cases; these three in a process of their own, the only one that imports torch) -> validate
export -> per variant (optimize -> [exclude: auto's sensitivity search] -> quantize -> A/B against
eager + gates, reports/<variant>.*) -> package.

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

from runtime.backends.onnxruntime import OnnxRuntimeBackend
from runtime.backends.registry import Target, open_backend
from runtime.cpu_kernels import KERNEL_DATA_FILE, KERNEL_MODEL_FILE
from runtime.memory import free_host_memory, measure_in_subprocess

from .accuracy import Inputs, Run, failed_gates, measure, reference_run
from .compare import Side, assemble, eager_side, read_inputs
from .errors import CompileProcessError, GateFailure, InsufficientDisk, InsufficientMemory, OutputError, RecipeError
from .export import OnnxArtifact, export
from .fusions import pack_matmuls, rotary_in_attention
from .load import Checkpoint, attention_for_export, fp32_weight_bytes, load_checkpoint, preflight, vocab_size
from .optimize import GENAI_MODEL_FILE, fold_rotary, kernel_graph, optimize, pack
from .package import (
    model_facts,
    remove_stale_staging,
    staging_folder,
    write_json,
    write_manifest,
    write_sidecars,
    write_tokenizer,
)
from .progress import StageLog, c_library_function, current_rss, release_freed_memory
from .quantize import check_finite, quantize
from .recipe import (
    DEFAULT_CALIBRATION,
    DEFAULT_MAX_CONTEXT,
    DEFAULT_PROMPTS,
    DEFAULT_TEXT,
    EngineSpec,
    Recipe,
    Variant,
    default_profiles,
    load_recipe,
    read_prompts,
    resolve_path,
    with_max_context,
)
from .report import largest_additions, layerwise_ends, write_report
from .sensitivity import layer_sensitivity, lightest_kept, residual_errors, weight_elements, weight_groups, with_exclude
from .tensorrt_build import PROFILES_FILE, EngineUnavailable, build_engine, engine_interface, engine_profiles
from .validate_export import CASES, EagerCase, eager_cases, validate_export

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
            with log.stage(f"variant {variant.name}", _describe(variant)):
                built[variant.name] = _build_variant(variant, exported, staging, data, eager, reference, recipe,
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


def _describe(variant: Variant) -> str:
    mode = variant.quantize.mode if variant.quantize else None
    parts = [variant.target, variant.precision, mode, "fused" if variant.fuse else None]
    return ", ".join(p for p in parts if p)


@dataclass
class ValidationData:
    inputs: Inputs
    prompts: list[str]
    calibration: dict[str, list[list[int]]]  # by variant name: its own calibration file, or the shipped set


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


def _build_variant(variant: Variant, exported: OnnxArtifact, staging: Path, data: ValidationData, eager: Side,
                   reference: Run, recipe: Recipe, base: Path, log: StageLog) -> dict[str, Any]:
    entry: dict[str, Any] = {"target": variant.target, "precision": variant.precision,
                             "quantize": variant.quantize.model_dump() if variant.quantize else None,
                             "fuse": variant.fuse}
    work = staging / ".work" / variant.name
    with log.step("optimize and check against the export"):
        graph, optimized = optimize(exported, variant.target, variant.fuse, work / "optimized")
    log.note(f"optimize: {optimized['nodes_before']} -> {optimized['nodes_after']} nodes; "
             + ", ".join(f"{k} {v}" for k, v in optimized["rules"].items()))
    for rule, why in optimized["unmatched"].items():
        log.note(f"  {rule} not applied: {why}")
    report: dict[str, Any] = {"optimize": optimized}
    gates = (variant.gates or recipe.validate_.gates).model_dump(exclude_none=True)
    if variant.quantize and variant.quantize.exclude == "auto":
        variant, report["exclude_auto"] = _auto_exclude(variant, graph, data, reference, gates, work, log)
    if variant.quantize or variant.precision != "fp32":
        calibration = data.calibration[variant.name]
        with log.step("quantize"):
            optimized_graph = graph
            graph, report["quantize"] = quantize(graph, variant, calibration, work / "quantized")
            check_finite(graph, calibration, variant.name)
        with log.step("layerwise error against fp32"):
            report["layerwise"] = residual_errors(optimized_graph, graph, calibration)
        _note_layerwise(report["layerwise"], log)
        _drop_superseded(optimized_graph, graph)
    if variant.target == Target.ONNXRUNTIME and variant.fuse:
        with log.step("pack_matmuls"):
            unpacked = graph
            graph, packed = pack(graph, work / "packed")
            _drop_superseded(unpacked, graph)
        optimized["rules"][pack_matmuls.NAME] = packed
        if packed:
            log.note(f"pack_matmuls: {packed} MatMuls joined their siblings (q/k/v, gate/up), {graph.node_count} nodes")
        else:
            optimized["unmatched"][pack_matmuls.NAME] = "no two MatMuls read one activation with weights of their own"
        with log.step("rotary into attention"):
            unfolded = graph
            exact = not variant.quantize and variant.precision == "fp32"
            graph, folded = fold_rotary(graph, work / "folded", exact)
            _drop_superseded(unfolded, graph)
        if isinstance(folded, str):
            optimized["rules"][rotary_in_attention.NAME] = 0
            optimized["unmatched"][rotary_in_attention.NAME] = folded
        else:
            optimized["rules"][rotary_in_attention.NAME] = folded
            log.note(f"rotary_in_attention: {folded} layers rotate inside GroupQueryAttention, {graph.node_count} "
                     f"nodes (the unfolded graph kept for onnxruntime-genai: {GENAI_MODEL_FILE})")
    activations = variant.quantize.kernel_activations if variant.quantize else "int8"
    kernels, kernels_why = _kernel_graph(graph, work / "kernels", variant.kv_cache, activations) \
        if variant.target == Target.ONNXRUNTIME else (None, "not an onnxruntime variant")
    if kernels is not None and variant.kv_cache == "float16" and kernels.interface["inputs"][3]["dtype"] != "float16":
        log.note(f"kv_cache {variant.kv_cache}: not applied (an attention of the graph is not Kiln's kernel's, "
                 "or another node reads the cache); the kernels' graph keeps an fp32 cache")
    if variant.target == Target.TENSORRT:  # validated below exactly as the engine will be driven
        graph = dataclasses.replace(graph, interface=engine_interface(graph.interface))

    def against_eager(backend: Any, stem: str, runs_on: str) -> dict[str, Any]:
        """The same A/B report compare-model writes, eager torch as A: reports/<stem>.{json,md,html}."""
        candidate = dataclasses.replace(eager, label=f"{recipe.name}:{variant.name}", backend=backend,
                                        description=f"{variant.name} ({_describe(variant)}), {runs_on}")
        comparison = assemble(eager, candidate, data.inputs, data.prompts, gates,
                              measure(backend, data.inputs, reference, into=work / "logits"))
        shutil.rmtree(work / "logits")
        for where in ("exclude_auto", "layerwise"):  # where the accuracy went, beside what it came to
            if where in report:
                comparison[where] = report[where]
        write_report(comparison, staging / "reports", stem=stem)
        return comparison

    release_freed_memory()  # what the last stage's sessions freed, before this one loads the weights
    with log.step("accuracy against eager"):
        backend = OnnxRuntimeBackend(graph.model_path, graph.interface)
        comparison = against_eager(backend, variant.name, "ONNX Runtime CPU")
        backend.close()  # before the memory measurement's process loads the graph again
    release_freed_memory()
    metrics, failures = comparison["summary"], comparison["failed_gates"]
    required = variant.cpu_kernels == "required"
    log.note(f"accuracy: perplexity {metrics['perplexity_change']:+.2%}, top-1 {metrics['top1_agreement']:.3f}, "
             f"greedy match {metrics['greedy_match']:.2f}, max |logit error| {metrics['max_logit_error']:.3g}"
             + (f"; {'missed (not gated: cpu_kernels required)' if required else 'FAILED'} {', '.join(failures)}"
                if failures else ""))
    kernel_summary: dict[str, Any] = {}
    kernel_failures: list[str] = []
    report["cpu_kernels"] = {"nodes": kernels_why if kernels is not None else 0}
    if kernels is not None:  # measured also where model.onnx failed: whether the kernels' graph would pass
        kernel_summary, kernels_why, kernel_failures = _kernel_accuracy(variant, kernels, against_eager, log)
        if not kernel_summary:
            shutil.rmtree(kernels.folder)
    if not kernel_summary:
        report["cpu_kernels"]["why_not"] = kernels_why
    model_failures: list[str] = []
    if required:  # the kernels' graph decides; model.onnx's misses are recorded, and the runtime never runs it
        model_failures = failures
        failures = [] if kernel_summary else [f"{f} on Kiln's CPU kernels" for f in kernel_failures] or [
            f"cpu_kernels required, but no graph for them passed or was measured: {str(kernels_why).splitlines()[0]}"]
    folder = staging / "variants" / variant.name
    folder.mkdir(parents=True)
    for name in graph.files:
        os.replace(graph.folder / name, folder / name)
    if kernel_summary:  # its graph and its packed weights; the rest it reads from the variant's own file
        os.replace(kernels.model_path, folder / KERNEL_MODEL_FILE)
        packed = [KERNEL_DATA_FILE] if KERNEL_DATA_FILE in kernels.files else []  # none: no packed weights
        for name in packed:
            os.replace(kernels.folder / name, folder / name)
        shutil.rmtree(kernels.folder)
        graph = dataclasses.replace(graph, files=[*graph.files, KERNEL_MODEL_FILE, *packed])
        kernel_summary["kernel_model"] = f"variants/{variant.name}/{KERNEL_MODEL_FILE}"
        if kernels.interface.get("prefill") == "batched":
            kernel_summary["kernel_prefill"] = "batched"
        if kernels.interface["inputs"][3]["dtype"] != graph.interface["inputs"][3]["dtype"]:
            kernel_summary["kernel_kv_cache"] = kernels.interface["inputs"][3]["dtype"]
        if "activations" in kernels.interface:
            kernel_summary["kernel_activations"] = kernels.interface["activations"]
    write_json(folder / "report.json", report)
    files = [f"variants/{variant.name}/{name}" for name in graph.files]
    summary = {"node_count": graph.node_count, "interface": graph.interface, "files": files, "model": files[0],
               "fusions": optimized["rules"], "fusions_not_applied": optimized["unmatched"], "gates": gates,
               "accuracy": metrics, "report": f"variants/{variant.name}/report.json",
               "comparison": f"reports/{variant.name}.html"}
    if GENAI_MODEL_FILE in graph.files:
        summary["genai_model"] = f"variants/{variant.name}/{GENAI_MODEL_FILE}"
    summary.update(kernel_summary)
    if required:
        summary["cpu_kernels"] = "required"
        if model_failures:
            summary["model_failed_gates"] = model_failures
    if variant.target == Target.ONNXRUNTIME:  # engines hold their memory on the GPU: not measured here
        with log.spinner("measuring memory in a fresh process"):
            # Of the graph a CPU host runs: the kernels' where it has them (their packed weights added).
            served, interface = (KERNEL_MODEL_FILE, kernels.interface) if kernel_summary else \
                (graph.files[0], graph.interface)
            summary["memory"] = measure_in_subprocess(folder / served, interface, recipe.export.max_context)
        memory = summary["memory"]
        log.note(f"memory: weights {memory['weights_bytes'] / 2**20:.0f} MiB resident, baseline "
                 f"{memory['baseline_bytes'] / 2**20:.0f} MiB, prefill activations "
                 f"{memory['activation_bytes_per_token'] / 1024:.1f} KiB a token + "
                 f"{memory['activation_bytes_per_pair']:.0f} B a token x slot")
    if failures:
        return {**entry, **summary, "status": "failed", "failed_gates": failures}
    if variant.target == Target.TENSORRT:
        return {**entry, **summary, **_engine(variant, graph, folder, recipe, base, log, against_eager)}
    return {**entry, **summary, "status": "built"}


def _kernel_graph(graph: OnnxArtifact, folder: Path, kv_cache: str,
                  activations: str) -> tuple[OnnxArtifact | None, int | str]:
    """kernel_graph, where a failure costs the variant only the kernels' graph (and is said why)."""
    try:
        return kernel_graph(graph, folder, kv_cache, activations)
    except Exception as error:  # noqa: BLE001 - an optional second graph: the variant ships without it
        shutil.rmtree(folder, ignore_errors=True)
        return None, f"the graph for them could not be written: {type(error).__name__}: {error}"


def _kernel_accuracy(variant: Variant, kernels: OnnxArtifact, against_eager: Any,
                     log: StageLog) -> tuple[dict[str, Any], str, list[str]]:
    """The graph for Kiln's CPU kernels measured against eager as the variant's graph was, under the same
    gates: its manifest keys where it passes, else nothing and why not; and the gates it missed. It is not
    held to fp32's tolerance against the variant's graph (compiler/optimize.py, kernel_graph)."""
    from runtime.cpu_kernels import library

    path, why = library()
    if path is None:
        log.note(f"cpu kernels: not run on this machine ({why}); the variant ships without their graph")
        return {}, f"not measured: the build machine cannot run them ({why})", []
    stem = f"{variant.name}+kernels"  # "+" is in no variant's name: no other report can be called this
    with log.step("accuracy against eager, Kiln's CPU kernels"):
        try:
            backend = OnnxRuntimeBackend(kernels.model_path, kernels.interface, kernels=path)
        except Exception as error:  # noqa: BLE001 - ONNX Runtime refused the graph: the variant ships without it
            log.note(f"cpu kernels: ONNX Runtime could not load their graph ({error}); the variant ships without it")
            return {}, f"ONNX Runtime could not load the graph: {error}", []
        comparison = against_eager(backend, stem, "ONNX Runtime CPU with Kiln's kernels")
        backend.close()
    release_freed_memory()
    metrics, failures = comparison["summary"], comparison["failed_gates"]
    log.note(f"cpu kernels: perplexity {metrics['perplexity_change']:+.2%}, top-1 "
             f"{metrics['top1_agreement']:.3f}, greedy match {metrics['greedy_match']:.2f}"
             + (f"; FAILED {', '.join(failures)}" + (": the variant fails (cpu_kernels required)"
                                                      if variant.cpu_kernels == "required"
                                                      else ": the variant ships without their graph")
                if failures else ""))
    if failures:
        return {}, f"failed {', '.join(failures)} against eager", failures
    return {"kernel_accuracy": metrics, "kernel_comparison": f"reports/{stem}.html"}, "", []


def _note_layerwise(records: list[dict[str, Any]], log: StageLog) -> None:
    if not records:
        log.note("layerwise error: no residual stream points named in this graph (skip norms: fuse is off)")
        return
    log.note(f"layerwise error: {layerwise_ends(records)}; most added by {largest_additions(records)}")


def _drop_superseded(old: OnnxArtifact, new: OnnxArtifact) -> None:
    """Delete a variant's graph that a later step has rewritten into a folder of its own, so a variant
    holds at most the graph it reads and the one it writes on disk (predicted_compile_disk)."""
    if new.folder != old.folder:
        shutil.rmtree(old.folder)


def _auto_exclude(variant: Variant, graph: OnnxArtifact, data: ValidationData, reference: Run,
                  gates: dict[str, float], work: Path, log: StageLog) -> tuple[Variant, dict[str, Any]]:
    """`quantize.exclude: auto` -> the variant with the module groups kept (in fp32, or in finer blocks with
    exclude_block_size) that lightest_kept finds meet its gates (compiler/sensitivity.py), and the
    sensitivity table and attempts behind that choice. The table is only measured when everything
    quantized misses a gate."""
    calibration = data.calibration[variant.name]
    finer = variant.quantize.exclude_block_size
    kept_as = f"in blocks of {finer}" if finer else "in fp32"
    groups = weight_groups(graph)
    attempts: list[dict[str, Any]] = []
    total = sum(sum(members.values()) for members in groups.values()) or 1

    def attempt(kept: Sequence[dict[str, Any]]) -> bool:
        candidate = with_exclude(variant, [m for r in kept for m in r["modules"]])
        built, _ = quantize(graph, candidate, calibration, work / "search" / "quantized")
        if variant.target == Target.ONNXRUNTIME and variant.fuse:
            built, _ = pack(built, work / "search" / "packed")
        backend = OnnxRuntimeBackend(built.model_path, built.interface)
        metrics = measure(backend, data.inputs, reference, into=work / "search" / "logits")["summary"]
        backend.close()
        shutil.rmtree(work / "search")
        release_freed_memory()  # the attempt's graphs and session, before the next one builds its own
        failures = failed_gates(metrics, gates)
        share = weight_elements(kept) / total
        attempts.append({"groups_kept": len(kept), "groups": [r["group"] for r in kept],
                         "weights_kept": share, "top1_agreement": metrics["top1_agreement"],
                         "perplexity_change": metrics["perplexity_change"], "failed_gates": failures})
        verdict = f"missed {', '.join(failures)}" if failures else "passed"
        log.note(f"  {len(kept)} of {len(groups)} groups {kept_as} ({share:.1%} of the MatMul weights): top-1 "
                 f"{metrics['top1_agreement']:.3f}, perplexity {metrics['perplexity_change']:+.2%}; {verdict}")
        return not failures

    # Everything quantized first: one build and measurement, where the ranking below costs one per group.
    with log.step("all quantized"):
        if attempt([]):
            log.note(f"exclude: auto: every group quantized meets the gates; none kept {kept_as}, no ranking "
                     "measured")
            return with_exclude(variant, []), {"sensitivity": [], "attempts": attempts, "kept_as": kept_as,
                                               "groups_kept": [], "weights_kept": 0.0, "met_gates": True}
    with log.step("sensitivity"), log.bar("module groups quantized alone", total=len(groups)) as advance:
        ranking = layer_sensitivity(graph, variant, groups, calibration, data.inputs.pad_id, work / "alone",
                                    on_group=advance)
    log.note("sensitivity, most sensitive first (KL from fp32 with that group alone quantized, calibration "
             "prompts): " + ", ".join(f"{r['group']} {r['kl_divergence']:.2g}" for r in ranking[:6]))

    with log.step("search"):  # none kept was the first attempt, and failed
        kept = lightest_kept(ranking, lambda groups: bool(groups) and attempt(groups))
    if kept is None:
        log.note(f"exclude: auto: the gates are missed even with all {len(ranking)} groups {kept_as}; building "
                 "with none kept, so the gates report what quantizing costs")
    met_gates, kept = kept is not None, kept or []
    return (with_exclude(variant, [m for r in kept for m in r["modules"]]),
            {"sensitivity": ranking, "attempts": attempts, "kept_as": kept_as,
             "groups_kept": [r["group"] for r in kept], "weights_kept": weight_elements(kept) / total,
             "met_gates": met_gates})


def _engine(variant: Variant, graph: OnnxArtifact, folder: Path, recipe: Recipe, base: Path, log: StageLog,
            against_eager: Any) -> dict[str, Any]:
    """Build the variant's engine beside its graph and hold the engine itself to the gates
    (reports/<variant>-engine.*), or record why this host cannot build it."""
    ranges = variant.profiles or default_profiles(recipe.export.max_context)
    profiles = engine_profiles(ranges, graph.interface)
    write_json(folder / PROFILES_FILE, profiles)
    spec = variant.engine or EngineSpec()
    cache = resolve_path(base, spec.timing_cache) if spec.timing_cache else None
    try:
        with log.spinner("building the TensorRT engine"):
            engine = build_engine(folder / graph.files[0], profiles, spec, cache, folder)
    except EngineUnavailable as exc:
        log.note(f"engine skipped: {exc}")
        return {"status": "skipped", "reason": str(exc), "profiles": ranges.model_dump()}
    log.note(f"engine built in {engine['build_seconds']} s on {engine['gpu']} (TensorRT {engine['tensorrt_version']})")
    facts = {**engine, "file": f"variants/{variant.name}/{engine['file']}"}
    backend = open_backend(folder.parents[1], {"engine": facts, "interface": graph.interface})
    comparison = against_eager(backend, f"{variant.name}-engine", f"TensorRT engine on {engine['gpu']}")
    built = {"engine": facts, "profiles": ranges.model_dump(), "engine_accuracy": comparison["summary"]}
    if comparison["failed_gates"]:
        log.note(f"engine FAILED {', '.join(comparison['failed_gates'])}")
        return {**built, "status": "failed", "failed_gates": comparison["failed_gates"]}
    return {**built, "status": "built"}


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
