"""What other tools need to open an onnxruntime variant's folder as it is: Optimum's
ORTModelForCausalLM reads config.json and generation_config.json, onnxruntime-genai reads
genai_config.json, and both load the tokenizer from the same folder. Every file is written from the
manifest (and the artifact's tokenizer/), never copied from the checkpoint, so it describes exactly
the graph beside it. These functions read the manifest's JSON document (`Manifest.document`), which
compile-model also hands them before the manifest is written. Polygraphy and trtexec need every
input's shape on the command line: `input_shapes` spells them out from the interface.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from .backends.base import expand, kv_order
from .backends.registry import opens_in_other_tools
from .errors import ArtifactError
from .files import link_or_copy
from .manifest import Interface, TensorSpec, Variant

if TYPE_CHECKING:
    from .artifact import Artifact

CONFIG = "config.json"
GENAI_CONFIG = "genai_config.json"
# The artifact's tokenizer/ folder holds these (generation_config.json: compile-model writes it there).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
# onnxruntime-genai 0.18 refuses a `type` it does not know (and its "gpt2" expects another graph); every
# Kiln graph is a plain decoder with the same inputs and outputs, which genai's "decoder" type runs.
GENAI_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi", "phi3", "gemma", "gemma2", "olmo",
                         "granite"})
# tokenizer_config.json keys transformers 5 writes that 4.x does not know, or passes on as bad arguments.
_TOKENIZER_KEYS_5X = ("backend", "is_local", "local_files_only")
SYMBOLS = ("batch", "seq", "past", "capacity")
# Optimum 2.1's ORTModelForCausalLM sizes the KV cache it feeds the first step from the config by model
# type (optimum/onnxruntime/modeling_decoder.py): num_key_value_heads only for these types, head_dim
# only for Gemma's; num_attention_heads and hidden_size / heads for every other type.
_OPTIMUM_KV_HEADS_TYPES = frozenset({"arcee", "deepseek_v3", "cohere", "gemma", "gemma3_text", "glm", "granite",
                                     "gpt_oss", "helium", "mistral", "llama", "nemotron", "qwen2", "qwen3",
                                     "qwen3_moe", "smollm3", "stablelm"})
_OPTIMUM_HEAD_DIM_TYPES = frozenset({"gemma", "gemma3_text", "gpt_oss", "nemotron"})


def portable_tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 names its own classes (TokenizersBackend, Qwen2Tokenizer over tokenizer.json), which
    4.x cannot import or maps to classes that rebuild the tokenizer their own way. Both versions load
    PreTrainedTokenizerFast, which is tokenizer.json as it is: exactly what Kiln's runtime encodes with."""
    portable = {k: v for k, v in config.items() if k not in _TOKENIZER_KEYS_5X}
    portable["tokenizer_class"] = "PreTrainedTokenizerFast"
    return portable


def optimum_problem(manifest: Mapping[str, Any], variant: str) -> str | None:
    """Why Optimum 2.1 cannot run the variant (it would feed a first-step cache of the wrong shape), or None
    (also where the manifest has no config to tell from)."""
    config, interface = manifest["model"].get("config"), Interface.of(manifest["variants"][variant]["interface"])
    if not config:
        return None
    model_type = manifest["model"]["model_type"]
    heads = config.get("num_attention_heads") or manifest["model"]["attention_heads"]
    if model_type in _OPTIMUM_KV_HEADS_TYPES:
        kv_heads = config.get("num_key_value_heads", heads)
    elif model_type == "falcon":
        kv_heads = config.get("num_kv_heads") if config.get("new_decoder_architecture") or \
            not config.get("multi_query") else 1
    else:
        kv_heads = heads
    head_dim = config.get("head_dim") if model_type in _OPTIMUM_HEAD_DIM_TYPES else \
        manifest["model"]["hidden_size"] // heads
    if (kv_heads, head_dim) == (interface.kv_heads, interface.head_dim):
        return None
    return (f"Optimum 2.1 sizes a {model_type} model's KV cache as {kv_heads} heads x {head_dim} from its config, "
            f"this graph's is {interface.kv_heads} x {interface.head_dim}: Optimum cannot run it (a limit of "
            "Optimum's ORTModelForCausalLM; onnxruntime-genai and Kiln run it)")


def sidecar_files(manifest: Mapping[str, Any], variant: str, tokenizer: Path,
                  kinds: tuple[str, ...] = ("optimum", "genai")) -> dict[str, bytes]:
    """File name -> bytes for one onnxruntime variant's folder, for the tools named in `kinds`."""
    entry = manifest["variants"][variant]
    if not opens_in_other_tools(Variant.of(variant, entry)):
        raise ArtifactError(f"variant {variant!r} is a {entry.get('target')} variant; only onnxruntime variants "
                            "open in Optimum and onnxruntime-genai")
    if "config" not in manifest["model"]:
        raise ArtifactError("this artifact was compiled before Kiln recorded the model's config in its manifest; "
                            "recompile it with compile-model")
    files: dict[str, bytes] = {}
    if "optimum" in kinds:
        files[CONFIG] = _json(manifest["model"]["config"])
    if "genai" in kinds:
        files[GENAI_CONFIG] = _json(genai_config(manifest, variant, _generation_config(tokenizer)))
    for name in TOKENIZER_FILES:
        path = tokenizer / name
        if path.is_file():
            data = path.read_bytes()
            if name == "tokenizer_config.json":  # artifacts compiled before it was written portable
                data = _json(portable_tokenizer_config(json.loads(data)))
            files[name] = data
    return files


def genai_config(manifest: Mapping[str, Any], variant: str, generation: dict[str, Any] | None = None) -> dict[str, Any]:
    """onnxruntime-genai's description of the variant's graph. A GroupQueryAttention graph reads and
    writes one KV buffer of the full context (past_present_share_buffer); the plain graph returns
    present = past + the new tokens."""
    model, entry = manifest["model"], manifest["variants"][variant]
    interface = Interface.of(entry["interface"])
    eos = model["eos_token_ids"] or [model["pad_token_id"]]
    pad = model["pad_token_id"] if model["pad_token_id"] is not None else eos[0]
    bos = model["bos_token_id"] if model["bos_token_id"] is not None else eos[0]
    generation = generation or {}
    sampling = bool(generation.get("do_sample", False))  # as transformers' generate() would, defaults included
    search = {
        "do_sample": sampling,
        "temperature": generation.get("temperature", 1.0),
        "top_k": generation.get("top_k", 50) if sampling else 1,
        "top_p": generation.get("top_p", 1.0),
        "repetition_penalty": generation.get("repetition_penalty", 1.0),
        "num_beams": 1,
        "num_return_sequences": 1,
        "min_length": 0,
        "max_length": model["max_context"],
        "length_penalty": 1.0,
        "early_stopping": True,
        "no_repeat_ngram_size": 0,
        "diversity_penalty": 0.0,
        "past_present_share_buffer": interface.shared_buffers,
    }
    return {
        "model": {
            "type": model["model_type"] if model["model_type"] in GENAI_TYPES else "decoder",
            "bos_token_id": bos,
            "eos_token_id": eos if len(eos) > 1 else eos[0],
            "pad_token_id": pad,
            "vocab_size": interface.vocab_size,
            "context_length": model["max_context"],
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                # A graph that rotates inside GroupQueryAttention has its unfolded twin beside it for
                # onnxruntime-genai, whose right-padded batches that rotation mis-positions.
                "filename": PurePosixPath(entry.get("genai_model", entry["model"])).name,
                "head_size": interface.head_dim,
                "hidden_size": model["hidden_size"],
                "num_attention_heads": model["attention_heads"],
                "num_key_value_heads": interface.kv_heads,
                "num_hidden_layers": interface.layers,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": _template(interface.past, ".key"),
                    "past_value_names": _template(interface.past, ".value"),
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": _template(interface.present, ".key"),
                    "present_value_names": _template(interface.present, ".value"),
                },
            },
        },
        "search": search,
    }


def input_shapes(interface: Interface, sizes: dict[str, int]) -> list[tuple[str, list[int]]]:
    """Every graph input with its concrete shape, for sizes of `batch`, `seq` and `past` (and `capacity`,
    the KV buffers' slots in a shared-buffer graph: past + seq unless given)."""
    unknown = sorted(set(sizes) - set(SYMBOLS))
    if unknown:
        raise ValueError(f"unknown size {unknown[0]!r}; give {', '.join(SYMBOLS[:3])} (and capacity)")
    missing = [s for s in SYMBOLS[:3] if s not in sizes]
    if missing:
        raise ValueError(f"missing size {missing[0]!r}; give batch, seq and past, as batch=1,seq=8,past=0")
    values = {"capacity": sizes["past"] + sizes["seq"], **sizes}
    if values["capacity"] < sizes["past"] + sizes["seq"]:
        raise ValueError(f"capacity {values['capacity']} is under past + seq = {sizes['past'] + sizes['seq']}")
    if (interface.shared_buffers and sizes["batch"] > 1 and sizes["seq"] > 1
            and sizes["past"] > 0):
        raise ValueError("a GroupQueryAttention graph runs seq > 1 after past tokens only at batch 1 (ONNX "
                         "Runtime's limit): use batch=1, seq=1 or past=0")
    layers, inputs = interface.layers, interface.inputs
    dims = {name: [_dim(d, values) for d in spec.shape] for spec in inputs for name in expand([spec], layers)}
    if interface.leading_kv_slot:  # the engine's masked slot at the front of the cache and the mask
        dims = {name: _with_slot(name, d) for name, d in dims.items()}
    # In the order the graph declares them, as the runtime binds them: key and value per layer.
    return [(name, dims[name]) for name in expand(inputs[:3], layers) + kv_order(expand(inputs[3:], layers))]


def parse_sizes(text: str) -> dict[str, int]:
    """"batch=1,seq=8,past=0" -> {"batch": 1, "seq": 8, "past": 0}; ValueError saying what is wrong."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(f"{part!r} is not NAME=NUMBER; write sizes as batch=1,seq=8,past=0")
        sizes[name.strip()] = int(value)
    return sizes


def polygraphy_argument(shapes: list[tuple[str, list[int]]]) -> str:
    """polygraphy run's --input-shapes, each shape quoted so a shell does not glob its brackets."""
    return "--input-shapes " + " ".join(f"'{name}:[{','.join(map(str, dims))}]'" for name, dims in shapes)


def trtexec_argument(shapes: list[tuple[str, list[int]]]) -> str:
    return "--shapes=" + ",".join(f"{name}:{'x'.join(map(str, dims))}" for name, dims in shapes)


def _dim(dim: int | str, values: dict[str, int]) -> int:
    if isinstance(dim, int):
        return dim
    return sum(values[term.strip()] for term in dim.split("+"))


def _with_slot(name: str, dims: list[int]) -> list[int]:
    if name == "attention_mask":
        return [dims[0], dims[1] + 1]
    if name.startswith("past_key_values."):
        return [dims[0], dims[1], dims[2] + 1, dims[3]]
    return dims


def _template(specs: Sequence[TensorSpec], suffix: str) -> str:
    name = next(s.name for s in specs if "{layer}" in s.name and s.name.endswith(suffix))
    return name.replace("{layer}", "%d")


def _generation_config(tokenizer: Path) -> dict[str, Any]:
    path = tokenizer / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _json(data: Any) -> bytes:
    return (json.dumps(data, indent=2) + "\n").encode()


def export_folder(artifact: Artifact, variant: str, tool: str, out: Path, link: bool = True) -> list[str]:
    """A new folder `tool` ("optimum" or "genai") opens as it is: the variant's graph files (hard links
    where the file system allows, else copies) and the files the tool reads, written from the
    manifest. It appears at `out` all at once. Returns the names written."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ArtifactError(f"{out}: already exists and is not an empty folder; choose a new folder")
    entry = artifact.manifest.variants[variant]
    if entry.model_failed_gates:  # the other tools run model.onnx, which no gate vouches for
        raise ArtifactError(f"variant {variant!r} is for Kiln's CPU kernels alone: its model.onnx, which {tool} would "
                            f"run, missed its gates ({', '.join(entry.model_failed_gates)}); export a variant "
                            "whose model.onnx passed them")
    document = artifact.manifest.document
    files = sidecar_files(document, variant, artifact.tokenizer_dir, (tool,))
    problem = optimum_problem(document, variant) if tool == "optimum" else None
    if problem:
        raise ArtifactError(problem)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for relative in entry.files:
            source, target = artifact.folder / relative, staging / PurePosixPath(relative).name
            link_or_copy(source, target, link)  # a copy on another file system, or with --copy
        for name, data in files.items():
            (staging / name).write_bytes(data)
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sorted([PurePosixPath(r).name for r in entry.files] + list(files))
