"""A variant's build: the named steps from the validated export to its manifest entry, in the order
they run (VARIANT_STEPS at the end of this module). Each step is a function of a VariantBuild, reads
what the steps before it left there and adds its own; a step that does not apply to the variant
returns at once.

    optimize      fusion for the variant's target, checked against the export        compiler/optimize.py
    exclude auto  which module groups stay fp32 (quantize.exclude: auto)             compiler/sensitivity.py
    quantize      the variant's precision, and where its error enters the layers     compiler/quantize.py
    pack          weight MatMuls that read one activation joined (fusions/pack_matmuls.py)
    rotary        the rotations folded into attention (fusions/rotary_in_attention.py)
    kernels       the graph for Kiln's CPU kernels                                    compiler/optimize.py
    accuracy      the graph A/B against eager under the gates: reports/<variant>.*
    kernels accuracy  the kernels' graph the same way: reports/<variant>+kernels.*
    placement     a CUDA variant's nodes against onnxruntime-gpu's CUDA kernels     compiler/cuda_placement.py
    files         the graphs moved into variants/<variant>/, its report.json
    entry         the manifest entry: interface, files, fusions, accuracy, status
    memory        resident memory measured in a fresh process (CPU variants)
    engine        a TensorRT variant's engine, held to the gates itself (GPU hosts)
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.backends.onnxruntime import OnnxRuntimeBackend
from runtime.backends.onnxruntime_cuda import CUDA_PROVIDERS, cuda_missing
from runtime.backends.registry import ONNXRUNTIME_TARGETS, Target, open_backend
from runtime.cpu_kernels import KERNEL_DATA_FILE, KERNEL_MODEL_FILE
from runtime.manifest import Variant as VariantEntry
from runtime.memory import measure_in_subprocess

from .accuracy import Inputs, Run, failed_gates, measure
from .bf16 import cpu_graph, twin_folder
from .compare import Side, assemble
from .cuda_placement import measure as measure_placement
from .cuda_placement import predict as predict_placement
from .fusions import PACK_MATMULS, ROTARY_IN_ATTENTION
from .graph import OnnxArtifact, load_structure
from .kv_rows import GATHER_FILE, SCATTER_FILE, write_kv_row_graphs
from .optimize import GENAI_MODEL_FILE, fold_rotary, kernel_graph, optimize, pack
from .package import write_json
from .progress import StageLog, release_freed_memory
from .quantize import check_finite, quantize
from .recipe import EngineSpec, Recipe, Variant, default_profiles, resolve_path
from .report import largest_additions, layerwise_ends, write_report
from .sensitivity import layer_sensitivity, lightest_kept, residual_errors, weight_elements, weight_groups, with_exclude
from .tensorrt_build import PROFILES_FILE, EngineUnavailable, build_engine, engine_interface, engine_profiles


@dataclass
class ValidationData:
    inputs: Inputs
    prompts: list[str]
    calibration: dict[str, list[list[int]]]  # by variant name: its own calibration file, or the shipped set


@dataclass
class VariantBuild:
    """One variant on its way from the export to its manifest entry: what every step reads and adds to."""

    variant: Variant  # as the recipe asks for it, until exclude: auto names the modules it keeps
    graph: OnnxArtifact  # the variant's graph as the last step left it
    staging: Path
    data: ValidationData
    eager: Side
    reference: Run
    recipe: Recipe
    base: Path
    log: StageLog
    report: dict[str, Any] = field(default_factory=dict)  # variants/<variant>/report.json
    kernels: OnnxArtifact | None = None  # the graph for Kiln's CPU kernels, where one was written
    kernels_why: int | str = ""  # its kernel node count, or why there is none
    failures: list[str] = field(default_factory=list)  # the gates the variant misses
    kernel_failures: list[str] = field(default_factory=list)
    model_failures: list[str] = field(default_factory=list)  # model.onnx's misses, where the kernels decide
    metrics: dict[str, Any] = field(default_factory=dict)
    kernel_entry: dict[str, Any] = field(default_factory=dict)  # the kernels' graph's manifest keys
    kv_rows: list[Path] = field(default_factory=list)  # a CUDA variant's row-move graphs (placement_step)
    folder: Path | None = None  # variants/<variant>/ in the staging folder
    entry: dict[str, Any] = field(default_factory=dict)  # the manifest entry
    asked: Variant | None = None  # the recipe's variant, as its manifest entry records it

    def __post_init__(self) -> None:
        self.asked = self.asked or self.variant

    @property
    def work(self) -> Path:
        return self.staging / ".work" / self.variant.name

    @property
    def optimized(self) -> dict[str, Any]:
        """The optimize report: `rules` {rule: count} and `unmatched` {rule: why}."""
        return self.report["optimize"]

    @property
    def gates(self) -> dict[str, float]:
        return (self.variant.gates or self.recipe.validate_.gates).model_dump(exclude_none=True)

    @property
    def fused_for_onnxruntime(self) -> bool:
        return self.variant.target in ONNXRUNTIME_TARGETS and self.variant.fuse

    def replace_graph(self, new: OnnxArtifact) -> None:
        """Take a step's rewritten graph, and delete the one it replaces where it wrote a folder of its own,
        so a variant holds at most the graph it reads and the one it writes on disk (predicted_compile_disk)."""
        if new.folder != self.graph.folder:
            shutil.rmtree(self.graph.folder)
            shutil.rmtree(twin_folder(self.graph), ignore_errors=True)  # a bf16 graph's fp32 twin, if one was run
        self.graph = new

    def against_eager(self, backend: Any, stem: str, runs_on: str) -> dict[str, Any]:
        """The same A/B report compare-model writes, eager torch as A: reports/<stem>.{json,md,html}."""
        variant = self.variant
        candidate = dataclasses.replace(self.eager, label=f"{self.recipe.name}:{variant.name}", backend=backend,
                                        description=f"{variant.name} ({describe(variant)}), {runs_on}")
        comparison = assemble(self.eager, candidate, self.data.inputs, self.data.prompts, self.gates,
                              measure(backend, self.data.inputs, self.reference, into=self.work / "logits"))
        shutil.rmtree(self.work / "logits")
        for where in ("exclude_auto", "layerwise"):  # where the accuracy went, beside what it came to
            if where in self.report:
                comparison[where] = self.report[where]
        write_report(comparison, self.staging / "reports", stem=stem)
        return comparison


def describe(variant: Variant) -> str:
    mode = variant.quantize.mode if variant.quantize else None
    parts = [variant.target, variant.precision, mode, "fused" if variant.fuse else None]
    return ", ".join(p for p in parts if p)


def build_variant(variant: Variant, exported: OnnxArtifact, staging: Path, data: ValidationData, eager: Side,
                  reference: Run, recipe: Recipe, base: Path, log: StageLog) -> dict[str, Any]:
    """Every step of VARIANT_STEPS on the variant, in order: its manifest entry."""
    build = VariantBuild(variant, exported, staging, data, eager, reference, recipe, base, log)
    for step in VARIANT_STEPS:
        step.run(build)
    return build.entry


# -- the steps, in the order they run ------------------------------------------------------------

def optimize_step(build: VariantBuild) -> None:
    log = build.log
    with log.step("optimize and check against the export"):
        build.graph, build.report["optimize"] = optimize(build.graph, build.variant.target, build.variant.fuse,
                                                         build.work / "optimized")
    optimized = build.optimized
    log.note(f"optimize: {optimized['nodes_before']} -> {optimized['nodes_after']} nodes; "
             + ", ".join(f"{k} {v}" for k, v in optimized["rules"].items()))
    for rule, why in optimized["unmatched"].items():
        log.note(f"  {rule} not applied: {why}")


def exclude_auto_step(build: VariantBuild) -> None:
    """`quantize.exclude: auto`: the variant with the module groups kept (compiler/sensitivity.py)."""
    if build.variant.quantize and build.variant.quantize.exclude == "auto":
        build.variant, build.report["exclude_auto"] = auto_exclude(build)


def quantize_step(build: VariantBuild) -> None:
    variant, log = build.variant, build.log
    if not variant.quantize and variant.precision == "fp32":
        return
    calibration = build.data.calibration[variant.name]
    with log.step("quantize"):
        optimized_graph = build.graph
        quantized, build.report["quantize"] = quantize(optimized_graph, variant, calibration,
                                                       build.work / "quantized")
        check_finite(cpu_graph(quantized), calibration, variant.name)
    with log.step("layerwise error against fp32"):
        build.report["layerwise"] = residual_errors(optimized_graph, cpu_graph(quantized), calibration)
    records = build.report["layerwise"]
    if records:
        log.note(f"layerwise error: {layerwise_ends(records)}; most added by {largest_additions(records)}")
    else:
        log.note("layerwise error: no residual stream points named in this graph (skip norms: fuse is off)")
    build.replace_graph(quantized)


def pack_step(build: VariantBuild) -> None:
    """pack_matmuls on the finished graph: after quantize, so that each layer's precision is decided first."""
    if not build.fused_for_onnxruntime:
        return
    with build.log.step("pack_matmuls"):
        packed_graph, packed = pack(build.graph, build.work / "packed")
        build.replace_graph(packed_graph)
    build.optimized["rules"][PACK_MATMULS.name] = packed
    if packed:
        build.log.note(f"pack_matmuls: {packed} MatMuls joined their siblings (q/k/v, gate/up), "
                       f"{build.graph.node_count} nodes")
    else:
        build.optimized["unmatched"][PACK_MATMULS.name] = f"no {PACK_MATMULS.looks_for} in the graph"


def rotary_step(build: VariantBuild) -> None:
    """rotary_in_attention on the packed graph, checked against the unfolded one (compiler/optimize.py)."""
    if not build.fused_for_onnxruntime:
        return
    variant = build.variant
    with build.log.step("rotary into attention"):
        exact = not variant.quantize and variant.precision == "fp32"
        folded_graph, folded = fold_rotary(build.graph, build.work / "folded", exact)
        build.replace_graph(folded_graph)
    if isinstance(folded, str):
        build.optimized["rules"][ROTARY_IN_ATTENTION.name] = 0
        build.optimized["unmatched"][ROTARY_IN_ATTENTION.name] = folded or f"no {ROTARY_IN_ATTENTION.looks_for}"
    else:
        build.optimized["rules"][ROTARY_IN_ATTENTION.name] = folded
        build.log.note(f"rotary_in_attention: {folded} layers rotate inside GroupQueryAttention, "
                       f"{build.graph.node_count} nodes (the unfolded graph kept for onnxruntime-genai: "
                       f"{GENAI_MODEL_FILE})")


def kernels_step(build: VariantBuild) -> None:
    """The graph for Kiln's CPU kernels, where a failure costs the variant only that graph (and says why)."""
    variant = build.variant
    if variant.target != Target.ONNXRUNTIME:
        build.kernels_why = f"not a CPU variant ({variant.target})"
        return
    activations = variant.quantize.kernel_activations if variant.quantize else "int8"
    folder = build.work / "kernels"
    try:
        build.kernels, build.kernels_why = kernel_graph(build.graph, folder, variant.kv_cache, activations)
    except Exception as error:  # noqa: BLE001 - an optional second graph: the variant ships without it
        shutil.rmtree(folder, ignore_errors=True)
        build.kernels_why = f"the graph for them could not be written: {type(error).__name__}: {error}"
        return
    if build.kernels is not None and variant.kv_cache != "float32" \
            and build.kernels.interface["inputs"][3]["dtype"] != variant.kv_cache:
        build.log.note(f"kv_cache {variant.kv_cache}: not applied (an attention of the graph is not Kiln's "
                       "kernel's, or another node reads the cache); the kernels' graph keeps an fp32 cache")


def accuracy_step(build: VariantBuild) -> None:
    """The variant's graph against eager under its gates (a TensorRT variant's exactly as its engine is driven)."""
    if build.variant.target == Target.TENSORRT:
        build.graph = dataclasses.replace(build.graph, interface=engine_interface(build.graph.interface))
    release_freed_memory()  # what the last stage's sessions freed, before this one loads the weights
    runs_on = "ONNX Runtime CPU" + (", the graph the CUDA provider runs"
                                    if build.variant.target == Target.ONNXRUNTIME_CUDA else "")
    runnable = cpu_graph(build.graph)
    if runnable is not build.graph:
        runs_on = "ONNX Runtime CPU, the bf16 graph's fp32 twin (compiler/bf16.py)"
    with build.log.step("accuracy against eager"):
        backend = OnnxRuntimeBackend(runnable.model_path, runnable.interface)
        comparison = build.against_eager(backend, build.variant.name, runs_on)
        backend.close()  # before the memory measurement's process loads the graph again
    release_freed_memory()
    build.metrics, build.failures = comparison["summary"], comparison["failed_gates"]
    metrics, required = build.metrics, build.variant.cpu_kernels == "required"
    build.log.note(
        f"accuracy: perplexity {metrics['perplexity_change']:+.2%}, top-1 {metrics['top1_agreement']:.3f}, "
        f"greedy match {metrics['greedy_match']:.2f}, max |logit error| {metrics['max_logit_error']:.3g}"
        + (f"; {'missed (not gated: cpu_kernels required)' if required else 'FAILED'} {', '.join(build.failures)}"
           if build.failures else ""))


def kernels_accuracy_step(build: VariantBuild) -> None:
    """The kernels' graph against eager as the variant's was, measured also where model.onnx failed (whether
    it would pass); with `cpu_kernels: required` it decides the variant's gates."""
    build.report["cpu_kernels"] = {"nodes": build.kernels_why if build.kernels is not None else 0}
    if build.kernels is not None:
        build.kernel_entry, build.kernels_why, build.kernel_failures = kernel_accuracy(build)
        if not build.kernel_entry:
            shutil.rmtree(build.kernels.folder)
    if not build.kernel_entry:
        build.report["cpu_kernels"]["why_not"] = build.kernels_why
    if build.variant.cpu_kernels != "required":
        return
    build.model_failures = build.failures  # recorded; the runtime never runs that model.onnx
    if build.kernel_entry:
        build.failures = []
    else:
        build.failures = [f"{f} on Kiln's CPU kernels" for f in build.kernel_failures] or [
            "cpu_kernels required, but no graph for them passed or was measured: "
            f"{str(build.kernels_why).splitlines()[0]}"]


def placement_step(build: VariantBuild) -> None:
    """A CUDA variant's finished graph against the CUDA kernels the pinned onnxruntime-gpu registers: a
    compute node that has none would run on the CPU, so the variant fails, naming it. Predicted on a host
    without CUDA; where this host runs CUDA, measured instead: ONNX Runtime's profile of a few steps."""
    if build.variant.target != Target.ONNXRUNTIME_CUDA:
        return
    with build.log.step("placement on CUDA"):
        if cuda_missing() is None:  # a GPU here: ONNX Runtime's profile says where each node ran
            placement = measure_placement(build.graph.model_path, build.graph.interface, list(CUDA_PROVIDERS),
                                          build.work / "placement")
        else:
            placement = predict_placement(load_structure(build.graph.model_path))
        # the two graphs that move the cache's rows on the GPU (files_step moves them beside the model)
        rows = build.work / "kv_rows"
        rows.mkdir(exist_ok=True)
        build.kv_rows = [rows / name for name in write_kv_row_graphs(rows, build.graph.interface["inputs"][3]["dtype"])]
        rows_off_cuda = [f"{path.name}: {node['why']}" for path in build.kv_rows
                         for node in predict_placement(load_structure(path)).on_cpu]
    build.report["cuda_placement"] = {**placement.to_json(), "kv_row_graphs_on_cpu": rows_off_cuda}
    build.log.note(f"placement: {placement.summary()}")
    if not placement.all_on_cuda:
        build.failures.append(f"cuda placement: {placement.summary()}")
    if rows_off_cuda:
        build.failures.append(f"cuda placement of the KV row moves: {'; '.join(rows_off_cuda)}")


def files_step(build: VariantBuild) -> None:
    """The graphs into variants/<variant>/ (the kernels' graph with its packed weights), and report.json."""
    folder = build.folder = build.staging / "variants" / build.variant.name
    folder.mkdir(parents=True)
    graph, kernels = build.graph, build.kernels
    for name in graph.files:
        os.replace(graph.folder / name, folder / name)
    if build.kernel_entry:  # the rest of its weights it reads from the variant's own file
        os.replace(kernels.model_path, folder / KERNEL_MODEL_FILE)
        packed = [KERNEL_DATA_FILE] if KERNEL_DATA_FILE in kernels.files else []  # none: no packed weights
        for name in packed:
            os.replace(kernels.folder / name, folder / name)
        shutil.rmtree(kernels.folder)
        build.graph = dataclasses.replace(graph, files=[*graph.files, KERNEL_MODEL_FILE, *packed])
        entry = build.kernel_entry
        entry["kernel_model"] = f"variants/{build.variant.name}/{KERNEL_MODEL_FILE}"
        if kernels.interface.get("prefill") == "batched":
            entry["kernel_prefill"] = "batched"
        if kernels.interface["inputs"][3]["dtype"] != graph.interface["inputs"][3]["dtype"]:
            entry["kernel_kv_cache"] = kernels.interface["inputs"][3]["dtype"]
        if "activations" in kernels.interface:
            entry["kernel_activations"] = kernels.interface["activations"]
    for path in build.kv_rows:  # a CUDA variant's row moves, run where the cache lives (placement_step)
        os.replace(path, folder / path.name)
    if build.kv_rows:
        build.graph = dataclasses.replace(build.graph, files=[*build.graph.files, *(p.name for p in build.kv_rows)])
    write_json(folder / "report.json", build.report)


def entry_step(build: VariantBuild) -> None:
    variant, graph, name = build.variant, build.graph, build.variant.name
    files = [f"variants/{name}/{file}" for file in graph.files]
    entry, asked = build.entry, build.asked  # quantize as the recipe says it (exclude: auto, not what it found)
    entry.update({"target": asked.target, "precision": asked.precision,
                  "quantize": asked.quantize.model_dump() if asked.quantize else None, "fuse": asked.fuse,
                  "node_count": graph.node_count, "interface": graph.interface, "files": files, "model": files[0],
                  "fusions": build.optimized["rules"], "fusions_not_applied": build.optimized["unmatched"],
                  "gates": build.gates, "accuracy": build.metrics, "report": f"variants/{name}/report.json",
                  "comparison": f"reports/{name}.html"})
    if GENAI_MODEL_FILE in graph.files:
        entry["genai_model"] = f"variants/{name}/{GENAI_MODEL_FILE}"
    if variant.target == Target.ONNXRUNTIME_CUDA:  # the runtime opens it with these (backends/registry.py)
        entry["providers"] = list(CUDA_PROVIDERS)
        entry["kv_row_graphs"] = [f"variants/{name}/{file}" for file in (GATHER_FILE, SCATTER_FILE)]
    entry.update(build.kernel_entry)
    if variant.cpu_kernels == "required":
        entry["cpu_kernels"] = "required"
        if build.model_failures:
            entry["model_failed_gates"] = build.model_failures
    entry["status"] = "failed" if build.failures else "built"
    if build.failures:
        entry["failed_gates"] = build.failures


def memory_step(build: VariantBuild) -> None:
    """Of the graph a CPU host runs: the kernels' where it has them (their packed weights added). Engines
    hold their memory on the GPU: not measured here."""
    if build.variant.target != Target.ONNXRUNTIME:
        return
    with build.log.spinner("measuring memory in a fresh process"):
        served, interface = (KERNEL_MODEL_FILE, build.kernels.interface) if build.kernel_entry else \
            (build.graph.files[0], build.graph.interface)
        memory = measure_in_subprocess(build.folder / served, interface, build.recipe.export.max_context)
    build.entry["memory"] = memory
    build.log.note(f"memory: weights {memory['weights_bytes'] / 2**20:.0f} MiB resident, baseline "
                   f"{memory['baseline_bytes'] / 2**20:.0f} MiB, prefill activations "
                   f"{memory['activation_bytes_per_token'] / 1024:.1f} KiB a token + "
                   f"{memory['activation_bytes_per_pair']:.0f} B a token x slot")


def engine_step(build: VariantBuild) -> None:
    """A TensorRT variant that passed: its engine built beside its graph and held to the gates itself
    (reports/<variant>-engine.*), or why this host cannot build it."""
    if build.variant.target != Target.TENSORRT or build.failures:
        return
    variant, graph, folder, log = build.variant, build.graph, build.folder, build.log
    ranges = variant.profiles or default_profiles(build.recipe.export.max_context)
    profiles = engine_profiles(ranges, graph.interface)
    write_json(folder / PROFILES_FILE, profiles)
    spec = variant.engine or EngineSpec()
    cache = resolve_path(build.base, spec.timing_cache) if spec.timing_cache else None
    try:
        with log.spinner("building the TensorRT engine"):
            engine = build_engine(folder / graph.files[0], profiles, spec, cache, folder)
    except EngineUnavailable as exc:
        log.note(f"engine skipped: {exc}")
        build.entry.update({"status": "skipped", "reason": str(exc), "profiles": ranges.model_dump()})
        return
    log.note(f"engine built in {engine['build_seconds']} s on {engine['gpu']} (TensorRT {engine['tensorrt_version']})")
    facts = {**engine, "file": f"variants/{variant.name}/{engine['file']}"}
    backend = open_backend(folder.parents[1], VariantEntry.of(variant.name, {**build.entry, "engine": facts}))
    comparison = build.against_eager(backend, f"{variant.name}-engine", f"TensorRT engine on {engine['gpu']}")
    build.entry.update({"engine": facts, "profiles": ranges.model_dump(), "engine_accuracy": comparison["summary"],
                        "status": "built"})
    if comparison["failed_gates"]:
        log.note(f"engine FAILED {', '.join(comparison['failed_gates'])}")
        build.entry.update({"status": "failed", "failed_gates": comparison["failed_gates"]})


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[VariantBuild], None]


VARIANT_STEPS = (
    Step("optimize", optimize_step),
    Step("exclude auto", exclude_auto_step),
    Step("quantize", quantize_step),
    Step("pack", pack_step),
    Step("rotary", rotary_step),
    Step("kernels", kernels_step),
    Step("accuracy", accuracy_step),
    Step("kernels accuracy", kernels_accuracy_step),
    Step("placement", placement_step),
    Step("files", files_step),
    Step("entry", entry_step),
    Step("memory", memory_step),
    Step("engine", engine_step),
)


# -- what two of the steps call ------------------------------------------------------------------

def kernel_accuracy(build: VariantBuild) -> tuple[dict[str, Any], str, list[str]]:
    """The graph for Kiln's CPU kernels measured against eager as the variant's graph was, under the same
    gates: its manifest keys where it passes, else nothing and why not; and the gates it missed. It is not
    held to fp32's tolerance against the variant's graph (compiler/optimize.py, kernel_graph)."""
    from runtime.cpu_kernels import library

    variant, log = build.variant, build.log
    path, why = library()
    if path is None:
        log.note(f"cpu kernels: not run on this machine ({why}); the variant ships without their graph")
        return {}, f"not measured: the build machine cannot run them ({why})", []
    stem = f"{variant.name}+kernels"  # "+" is in no variant's name: no other report can be called this
    with log.step("accuracy against eager, Kiln's CPU kernels"):
        try:
            backend = OnnxRuntimeBackend(build.kernels.model_path, build.kernels.interface, kernels=path)
        except Exception as error:  # noqa: BLE001 - ONNX Runtime refused the graph: the variant ships without it
            log.note(f"cpu kernels: ONNX Runtime could not load their graph ({error}); the variant ships without it")
            return {}, f"ONNX Runtime could not load the graph: {error}", []
        comparison = build.against_eager(backend, stem, "ONNX Runtime CPU with Kiln's kernels")
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


def auto_exclude(build: VariantBuild) -> tuple[Variant, dict[str, Any]]:
    """`quantize.exclude: auto` -> the variant with the module groups kept (in fp32, or in finer blocks with
    exclude_block_size) that lightest_kept finds meet its gates (compiler/sensitivity.py), and the
    sensitivity table and attempts behind that choice. The table is only measured when everything
    quantized misses a gate."""
    variant, graph, data, work, log, gates = build.variant, build.graph, build.data, build.work, build.log, build.gates
    calibration = data.calibration[variant.name]
    finer = variant.quantize.exclude_block_size
    kept_as = f"in blocks of {finer}" if finer else "in fp32"
    groups = weight_groups(graph)
    attempts: list[dict[str, Any]] = []
    total = sum(sum(members.values()) for members in groups.values()) or 1

    def attempt(kept: Sequence[dict[str, Any]]) -> bool:
        candidate = with_exclude(variant, [m for r in kept for m in r["modules"]])
        built, _ = quantize(graph, candidate, calibration, work / "search" / "quantized")
        if build.fused_for_onnxruntime:
            built, _ = pack(built, work / "search" / "packed")
        built = cpu_graph(built)  # a bf16 graph's fp32 twin (compiler/bf16.py)
        backend = OnnxRuntimeBackend(built.model_path, built.interface)
        metrics = measure(backend, data.inputs, build.reference, into=work / "search" / "logits")["summary"]
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
