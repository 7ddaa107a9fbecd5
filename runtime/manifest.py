"""manifest.json, the contract between compile-model and the runtime, as frozen types: parsed and
checked here, in one place, before the runtime acts on any of it, and checked here again by
compiler/package.py before it writes one (a compile cannot write a manifest the runtime refuses).

    Manifest         schema_version, name, created, model (ModelFacts), variants, files; `document`
                     is the JSON as written, for what the runtime only shows or passes on (recipe,
                     source, tools, export, compile)
      ModelFacts     family, max context, token ids, the checkpoint's config.json
      Variant        one entry of `variants`: its target, status, the files it runs (model, the
                     kernels' graph, a TensorRT engine), its interface and memory; `document` keeps
                     the build's record (accuracy, fusions, gates, reports)
        Interface    the graph's inputs and outputs (TensorSpec: name, dtype, shape) and KV layout
      FileEntry      sha256 and size of each file the artifact holds

The compiler builds each interface as the JSON mapping it writes, step by step; what runs a graph
takes it through Interface.of.

Schema 1 and 2 both load. Version 2 marks an artifact with a variant for Kiln's CPU kernels alone
(`cpu_kernels: required`): a runtime that reads version 1 alone does not know that key and would run
the variant's model.onnx, a graph that may have missed its gates, so it refuses the artifact instead.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from types import MappingProxyType
from typing import Any

from .errors import ArtifactError, IncompatibleArtifact
from .signing import SIGNATURE_FILE

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
KERNELS_ONLY_SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (SCHEMA_VERSION, KERNELS_ONLY_SCHEMA_VERSION)
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,99}")  # the recipe's name rule: the version folder is named after it
STATUSES = ("built", "failed", "skipped")
LIST_KEYS = ("files", "sidecars", "failed_gates", "model_failed_gates", "kv_row_graphs", "providers")
INT8_KV_BLOCK = 16  # an int8 KV cache's numbers a scale: a slot's codes, then an fp32 scale a block (attention.c)


def int8_kv_width(head_dim: int) -> int:
    """Bytes a slot of a KV head takes in an int8 cache: its codes, and an fp32 scale a block of them."""
    return head_dim + 4 * (head_dim // INT8_KV_BLOCK)


# What the backends, memory planning and interop read of an interface.
INTERFACE_KEYS = {"inputs": list, "outputs": list, "layers": int, "kv_heads": int, "head_dim": int, "vocab_size": int}


class ManifestError(ArtifactError):
    """manifest.json is unsafe or incomplete to act on."""


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int


@dataclass(frozen=True)
class TensorSpec:
    name: str  # KV tensors' names are templates over "{layer}"
    dtype: str  # numpy's name: float32, float16, int64
    shape: tuple[int | str, ...]  # symbols: batch, seq, past, capacity, past + seq


@dataclass(frozen=True)
class Interface:
    """A graph's inputs and outputs as the runtime binds them: input_ids, attention_mask, position_ids and
    past KV; logits and present KV (docs/artifact.md, the graph interface)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    logits: str = "all"  # "last": the logits of each row's last position only
    kv_sharing: str = "none"  # "shared-buffer": past and present are one buffer, updated in place
    row_lengths: str | None = None  # "mask": rows stored from slot 0, each row's length read from its mask
    leading_kv_slot: bool = False  # a TensorRT engine's masked slot in front of every cache
    prefill: str = "rows"  # "batched": first prompts of different lengths in one step (Kiln's kernels)
    activations: str | None = None  # Kiln's 4-bit kernels' activations (bfloat16)

    @classmethod
    def of(cls, value: Interface | Mapping[str, Any]) -> Interface:
        """The typed interface of one as the manifest (or a compile step) writes it."""
        if isinstance(value, Interface):
            return value
        specs = lambda entries: tuple(TensorSpec(e.get("name", ""), e.get("dtype", "float32"),  # noqa: E731
                                                 tuple(e.get("shape", ()))) for e in entries)
        return cls(specs(value.get("inputs", ())), specs(value.get("outputs", ())), value["layers"], value["kv_heads"],
                   value["head_dim"], value.get("vocab_size", 0), value.get("logits", "all"),
                   value.get("kv_sharing", "none"), value.get("row_lengths"), bool(value.get("leading_kv_slot")),
                   value.get("prefill") or "rows", value.get("activations"))

    @property
    def past(self) -> tuple[TensorSpec, ...]:
        return self.inputs[3:]

    @property
    def present(self) -> tuple[TensorSpec, ...]:
        return self.outputs[1:]

    @property
    def kv_dtype(self) -> str:
        return self.past[0].dtype

    @property
    def kv_width(self) -> int:
        """A KV tensor's last dimension: the head size, and in an int8 cache (Kiln's kernels' kv_cache: int8)
        4 bytes more for each block of 16 codes, their scale (runtime/kernels/attention.c)."""
        return int8_kv_width(self.head_dim) if self.kv_dtype == "int8" else self.head_dim

    @property
    def logits_dtype(self) -> str:
        return self.outputs[0].dtype

    @property
    def shared_buffers(self) -> bool:
        return self.kv_sharing == "shared-buffer"

    def with_kv_dtype(self, dtype: str) -> Interface:
        """The interface with its past and present KV tensors of type `dtype`."""
        retyped = lambda specs: tuple(dataclasses.replace(s, dtype=dtype) for s in specs)  # noqa: E731
        return dataclasses.replace(self, inputs=self.inputs[:3] + retyped(self.past),
                                   outputs=self.outputs[:1] + retyped(self.present))

    def to_json(self) -> dict[str, Any]:
        """As the manifest writes it (keys that are their defaults left out, as the compiler leaves them)."""
        specs = lambda entries: [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in entries]  # noqa: E731
        document = {"inputs": specs(self.inputs), "outputs": specs(self.outputs), "layers": self.layers,
                    "logits": self.logits, "kv_sharing": self.kv_sharing, "kv_heads": self.kv_heads,
                    "head_dim": self.head_dim, "vocab_size": self.vocab_size}
        for key, default in (("row_lengths", None), ("leading_kv_slot", False), ("prefill", "rows"),
                             ("activations", None)):
            if getattr(self, key) != default:
                document[key] = getattr(self, key)
        return document


@dataclass(frozen=True)
class ModelFacts:
    """What the runtime needs to know about the model besides the graph interface."""

    family: str
    max_context: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    model_type: str | None
    config: Mapping[str, Any] | None  # the checkpoint's config.json, as transformers 4 and 5 read it


@dataclass(frozen=True)
class Variant:
    """One variant's manifest entry. Which backend runs it is runtime/backends/registry.py's question
    (kind_of): a TensorRT `engine`, or an ONNX `model`."""

    name: str
    target: str  # the recipe's target (runtime/backends/registry.py Target)
    status: str  # built, failed (missed its gates: loads only when named), skipped (not built, `reason`)
    reason: str | None
    precision: str | None
    quantize: Mapping[str, Any] | None
    interface: Interface | None
    files: tuple[str, ...]
    model: str | None  # the ONNX graph (variants/<name>/model.onnx)
    genai_model: str | None  # the graph onnxruntime-genai opens, where model.onnx folds rotary into attention
    engine: Mapping[str, Any] | None  # a TensorRT variant's engine facts: file, profiles_file, versions, GPU
    providers: tuple[str, ...] | None  # the ONNX Runtime providers a CUDA variant is built for, in order
    kv_row_graphs: tuple[str, ...]  # a CUDA variant's graphs that move cache rows on the device: gather, scatter
    # The graph for Kiln's CPU kernels, and what it changes of the interface.
    kernel_model: str | None
    kernel_prefill: str | None  # "batched": every prompt row in one step
    kernel_kv_cache: str | None  # its cache's dtype, where it differs from the interface's
    kernel_activations: str | None
    cpu_kernels: str | None  # "required": the variant runs on the kernels alone, never its model.onnx
    failed_gates: tuple[str, ...]
    model_failed_gates: tuple[str, ...]  # model.onnx's misses where the kernels decide the gates
    memory: Mapping[str, float] | None  # measured at compile: baseline, weights, activations
    sidecars: tuple[str, ...]  # config.json, genai_config.json, tokenizer beside the graph
    document: Mapping[str, Any]  # the entry as written, the build's record included

    @classmethod
    def of(cls, name: str, entry: dict[str, Any]) -> Variant:
        """The typed view of an entry that passed the manifest's checks (or that a compile step holds)."""
        return _variant(name, entry)

    @property
    def built(self) -> bool:
        return self.status == "built"

    def why_not_built(self) -> str:
        return self.reason or ", ".join(self.failed_gates) or self.status


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    name: str
    created: str | None
    model: ModelFacts
    variants: Mapping[str, Variant]  # in the order the recipe lists them
    files: Mapping[str, FileEntry]
    document: Mapping[str, Any]  # manifest.json as written

    @classmethod
    def parse(cls, document: Any, where: str = "the manifest") -> Manifest:
        """The typed manifest of a parsed manifest.json; one line naming the first problem otherwise:
        IncompatibleArtifact for a schema this runtime does not read, ManifestError for the rest."""
        if not isinstance(document, dict):
            raise ManifestError(f"{where}: the manifest is not a JSON object")
        version = document.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            raise IncompatibleArtifact(
                f"{where}: manifest schema version {version}, this runtime reads versions "
                f"{' and '.join(map(str, READABLE_SCHEMA_VERSIONS))}")
        problem = _problem(document)
        if problem:
            raise ManifestError(f"{where}: {problem}")
        files = {path: FileEntry(entry["sha256"], entry["size"]) for path, entry in document["files"].items()}
        variants = {name: _variant(name, entry) for name, entry in document["variants"].items()}
        return cls(version, document["name"], document.get("created"), _model_facts(document["model"]),
                   MappingProxyType(variants), MappingProxyType(files), MappingProxyType(document))

    def built(self) -> dict[str, Variant]:
        return {name: variant for name, variant in self.variants.items() if variant.built}

    def to_json(self) -> dict[str, Any]:
        return dict(self.document)


def schema_version_for(variants: Mapping[str, Mapping[str, Any]]) -> int:
    """The oldest schema a runtime must read to run these variants' entries correctly."""
    required = any(entry.get("cpu_kernels") == "required" for entry in variants.values())
    return KERNELS_ONLY_SCHEMA_VERSION if required else SCHEMA_VERSION


def safe_relative(name: str) -> str | None:
    """Why `name` may not be a path inside an artifact, or None if it may."""
    if not name or name.startswith("/") or "\\" in name or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    parts = PurePosixPath(name).parts
    if ".." in parts:
        return "a path that climbs out of its folder (..)"
    if any(p in ("", ".") for p in name.split("/")):
        return "a path with empty or '.' parts"
    return None


# -- the checks, then the types built from a document that passed them -----------------------------

def _problem(manifest: dict[str, Any]) -> str | None:
    """What makes `manifest` unsafe to act on (names, paths, shapes), or None."""
    if not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        return "the manifest lists no files"
    name = manifest.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return f"the manifest's name {name!r} is not [a-z0-9][a-z0-9._-]*"
    files = manifest["files"]
    for path, entry in files.items():
        problem = safe_relative(path)
        if problem or path in (MANIFEST, SIGNATURE_FILE):
            return f"the manifest lists {path!r}, {problem or 'a reserved name'}"
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or entry["size"] < 0 \
                or not isinstance(entry.get("sha256"), str):
            return f"the manifest's entry for {path!r} has no valid size and sha256"
    folders = {str(parent) for path in files for parent in PurePosixPath(path).parents}
    clash = next((path for path in files if path in folders), None)
    if clash:
        return f"the manifest lists {clash!r} both as a file and as a folder"
    model = manifest.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("max_context"), int):
        return "the manifest's model facts have no max_context"
    variants = manifest.get("variants")
    if not isinstance(variants, dict) or not all(isinstance(v, dict) for v in variants.values()):
        return "the manifest's variants are not a mapping of variant entries"
    for variant, entry in variants.items():
        problem = _variant_problem(entry, files)
        if problem:
            return f"variant {variant!r} {problem}"
    return None


def _variant_problem(entry: dict[str, Any], files: dict[str, Any]) -> str | None:
    if entry.get("status") not in STATUSES:
        return f"has status {entry.get('status')!r}, not one of {', '.join(STATUSES)}"
    for key in LIST_KEYS:
        value = entry.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return f"has {key} that is not a list of strings"
    for key in ("files", "sidecars", "kv_row_graphs"):  # what export-for links and the CUDA backend loads
        unlisted = next((path for path in entry.get(key) or () if path not in files), None)
        if unlisted is not None:
            return f"points at {unlisted!r} ({key}), which the manifest does not list"
    for key, kind in (("quantize", dict), ("memory", dict), ("target", str), ("reason", str)):
        if entry.get(key) is not None and not isinstance(entry[key], kind):
            return f"has a {key} that is not a {kind.__name__}"
    if isinstance(entry.get("memory"), dict) and not all(isinstance(v, int | float) for v in entry["memory"].values()):
        return "has memory figures that are not numbers"
    engine = entry.get("engine")
    if engine is not None and not (isinstance(engine, dict) and isinstance(engine.get("file"), str)):
        return "has an engine entry without a file"
    if entry.get("providers") == []:
        return "has an empty list of providers"
    engine = engine or {}
    for key, path in (("model", entry.get("model")), ("kernel_model", entry.get("kernel_model")),
                      ("genai_model", entry.get("genai_model")), ("engine", engine.get("file"))):
        if path is not None and (not isinstance(path, str) or path not in files):
            return f"points at {path!r} ({key}), which the manifest does not list"
    profiles = engine.get("profiles_file")
    if profiles is not None:
        folder = PurePosixPath(engine.get("file", "")).parent / str(profiles)
        if folder.as_posix() not in files:
            return f"points at {folder.as_posix()!r}, which the manifest does not list"
    interface = entry.get("interface")
    if interface is None and entry["status"] == "built":
        return "is built but has no interface"
    if interface is not None:
        if not isinstance(interface, dict):
            return "has an interface that is not a mapping"
        wrong = next((key for key, kind in INTERFACE_KEYS.items() if not isinstance(interface.get(key), kind)), None)
        if wrong:
            return f"has an interface without a valid {wrong!r}"
        if len(interface["inputs"]) < 4 or len(interface["outputs"]) < 2 or not all(
                isinstance(io, dict) and isinstance(io.get("name"), str) and isinstance(io.get("dtype"), str)
                and isinstance(io.get("shape", []), list) for io in interface["inputs"] + interface["outputs"]):
            return "has an interface whose inputs or outputs lack names and dtypes"
    if entry["status"] == "built" and entry.get("model") is None and entry.get("engine") is None:
        return "is built but names no file to run (model or engine); recompile the artifact"
    return None


def _tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, list | tuple) else ()


def _variant(name: str, entry: dict[str, Any]) -> Variant:
    return Variant(
        name=name, target=entry.get("target", "?"), status=entry["status"], reason=entry.get("reason"),
        precision=entry.get("precision"), quantize=entry.get("quantize"),
        interface=Interface.of(entry["interface"]) if isinstance(entry.get("interface"), dict) else None,
        files=_tuple(entry.get("files")), model=entry.get("model"), genai_model=entry.get("genai_model"),
        engine=entry.get("engine"), kernel_model=entry.get("kernel_model"),
        providers=tuple(entry["providers"]) if entry.get("providers") is not None else None,
        kv_row_graphs=_tuple(entry.get("kv_row_graphs")),
        kernel_prefill=entry.get("kernel_prefill"), kernel_kv_cache=entry.get("kernel_kv_cache"),
        kernel_activations=entry.get("kernel_activations"), cpu_kernels=entry.get("cpu_kernels"),
        failed_gates=_tuple(entry.get("failed_gates")), model_failed_gates=_tuple(entry.get("model_failed_gates")),
        memory=entry.get("memory"), sidecars=_tuple(entry.get("sidecars")), document=MappingProxyType(entry))


def _model_facts(model: dict[str, Any]) -> ModelFacts:
    eos = model.get("eos_token_ids")
    return ModelFacts(family=model.get("family", "?"), max_context=model["max_context"],
                      eos_token_ids=tuple(eos) if isinstance(eos, list) else (),
                      bos_token_id=model.get("bos_token_id"), pad_token_id=model.get("pad_token_id"),
                      model_type=model.get("model_type"), config=model.get("config"))
