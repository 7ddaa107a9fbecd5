"""The model-family table: every difference between supported families, as data.

Keyed by the checkpoint config's `model_type` (GGUF-loaded configs carry no `architectures`, so the
model type is the key that every source has). Adding a family is one entry here plus its tiny-model
config in tests/conftest.py; tests/compiler/test_families.py fails until both exist.

The export itself is family-independent: it drives the transformers model through its Cache
classes, so what differs per family is only how to read the shapes the graph interface needs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import UnsupportedArchitecture


@dataclass(frozen=True)
class Family:
    name: str
    # "rotary" positions extend to any length the recipe asks for (within the config's limit);
    # "learned" positions are a table, so max_context can never exceed it.
    positions: str = "rotary"
    # Config attributes, in order of preference, that give the number of KV heads.
    kv_heads_attrs: tuple[str, ...] = ("num_key_value_heads", "num_attention_heads")
    # The transformers attention implementation the export traces (see compiler/load.py): "grouped"
    # is compiler/attention.py, for families whose attention goes through AttentionInterface with the
    # standard (module, query, key, value, mask, scaling) call; others keep transformers' "eager".
    attention: str = "grouped"
    notes: str = ""
    # Why a family transformers has is refused (the export cannot trace it), in one line; None: supported.
    refused: str | None = None
    # Where the config's attributes do not say how many KV heads the cache holds: a function of the config.
    cache_heads: Callable[[Any], int] | None = None
    # The config.json keys transformers 4.x reads the rotary base and rotary fraction from (5.x keeps
    # both inside `rope_parameters`): written beside it so 4.x tools (Optimum) read the same model.
    legacy_rope_keys: tuple[str, str] = ("rope_theta", "partial_rotary_factor")


def falcon_cache_heads(config: Any) -> int:
    """Falcon's cache holds what its attention repeats the KV heads to, not what its config names:
    all the query heads in the new decoder architecture (Falcon 40B/180B), else num_kv_heads, or 1 for
    multi-query (7B) (transformers' FalconAttention.forward)."""
    if config.new_decoder_architecture:
        return config.num_attention_heads
    return 1 if config.multi_query else config.num_kv_heads


# Why BLOOM and MPT are refused. Falcon's ALiBi option compiles (its eager attention is traced, and its
# bfloat16 bias arithmetic widened: export.widen_bf16_arithmetic).
ALIBI = ("its attention adds an ALiBi position bias through an attention of its own that Kiln has no row for "
         "(not transformers' attention interface), and its config sets no position limit; Falcon's ALiBi "
         "compiles")

# What differs between families that the export and the fusions must know is read from the config
# (head_dim, layer_types for sliding windows, attention scaling and soft-caps come through the
# traced graph itself); a row records only what the config does not say.
FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", notes="SmolLM2, TinyLlama, Llama 2/3; GQA"),
    "mistral": Family("Mistral", notes="GQA, sliding window"),
    "qwen2": Family("Qwen2", notes="GQA, QKV bias"),
    "qwen3": Family("Qwen3", notes="GQA, q/k RMSNorm, explicit head_dim"),
    "phi3": Family("Phi-3", notes="fused qkv and gate_up projections, su/longrope scaling"),
    "phi": Family("Phi", notes="phi-2: partial rotary, parallel attention and MLP, LayerNorm, dense bias"),
    "gemma": Family("Gemma", notes="RMSNorm with 1 + weight, scaled embeddings, GeGLU"),
    "gemma2": Family("Gemma 2", notes="soft-capped attention and logits, alternating sliding-window layers, "
                                      "pre/post norms"),
    "gpt_neox": Family("GPT-NeoX", notes="Pythia: partial rotary, parallel residual, fused qkv",
                       legacy_rope_keys=("rotary_emb_base", "rotary_pct")),
    "falcon": Family("Falcon", cache_heads=falcon_cache_heads, attention="eager",
                     notes="new decoder architecture, multi-query; its attention does not go through "
                           "AttentionInterface, so the export traces transformers' eager attention"),
    "olmo": Family("OLMo", notes="non-parametric LayerNorm, optional qkv clipping"),
    "olmo2": Family("OLMo 2", notes="post-norms, q/k RMSNorm"),
    "stablelm": Family("StableLM", notes="partial rotary, LayerNorm"),
    "granite": Family("Granite", notes="embedding, attention, residual and logits multipliers"),
    "starcoder2": Family("Starcoder2", notes="sliding window, LayerNorm, GELU MLP with bias"),
    # GPT-2: fused c_attn Conv1D, learned position table, LayerNorm + GELU; multi-head KV.
    "gpt2": Family("GPT-2", positions="learned", kv_heads_attrs=("n_head",), attention="eager"),
    "mixtral": Family("Mixtral", notes="mixture of experts: softmax top-k, renormalized"),
    "bloom": Family("BLOOM", refused=ALIBI),
    "mpt": Family("MPT", refused=ALIBI),
}


# Configurations of a model type the export cannot take: a function of the config's values -> why (None: fine).
# None now: PhiMoE's longrope, the last, exports through export.traceable_rotary.
CONFIG_REFUSALS: dict[str, Callable[[dict], str | None]] = {}


def supported() -> str:
    return ", ".join(f"{f.name} ({key})" for key, f in FAMILIES.items() if f.refused is None)


def family_for(config: object) -> Family:
    """The row of a transformers config; for a model type the table lacks, the generic row where the
    model class and config are of the standard kind (see generic_family)."""
    model_type = getattr(config, "model_type", None)
    family = family_named(model_type, config_values(config) if hasattr(config, "to_dict") else None)
    if model_type not in FAMILIES:
        _check_standard_attention(model_type)
    return family


def config_values(config: Any) -> dict[str, Any]:
    """A transformers config's values by transformers' names: its file's keys, and the standard sizes as
    the object answers them, where its class maps them from older names (attribute_map: GPT-J's n_embd,
    n_layer, n_head, n_positions)."""
    return {**config.to_dict(), **{key: getattr(config, key, None) for key in STANDARD_CONFIG_KEYS}}


def family_named(model_type: str | None, config: dict | None = None, file_keys: bool = False) -> Family:
    """The row of a config's model_type; for another type with its config (`config`: config_values), the
    generic row or UnsupportedArchitecture naming it and what is missing. `file_keys`: config is
    config.json as written, before transformers reads it: sizes under their older names
    (OLD_CONFIG_NAMES) count, and the loaded config answers for them."""
    refusal = CONFIG_REFUSALS.get(model_type)
    reason = refusal(config) if refusal is not None and config else None
    if reason:
        raise UnsupportedArchitecture(f"model type {model_type!r} is refused: {reason}")
    family = FAMILIES.get(model_type)
    if family is None:
        return generic_family(model_type, config, file_keys)
    if family.refused:
        raise UnsupportedArchitecture(f"model type {model_type!r} ({family.name}) is refused: {family.refused}")
    return family


# What a decoder's config must hold for the graph interface to be read without a row (Shapes).
STANDARD_CONFIG_KEYS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size",
                        "max_position_embeddings")
# The older names config.json files use for them, which the config classes map (attribute_map): the check
# before loading (config.json alone, no transformers) takes them as present, the loaded config decides.
OLD_CONFIG_NAMES = {"num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
                    "num_attention_heads": ("n_head", "n_heads", "num_heads"),
                    "hidden_size": ("n_embd", "d_model"), "max_position_embeddings": ("n_positions", "max_seq_len")}
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


def generic_family(model_type: str | None, config: dict | None, file_keys: bool = False) -> Family:
    """A model type outside the table compiles as it is when its config is of the standard kind (the
    shapes under transformers' names, attention layers only) and, checked once transformers is
    loaded, its model class goes through AttentionInterface and its experts, if any, are of the kind
    ONNX Runtime's MoE op computes (compiler/moe.py). The export validation against eager and the
    fused-vs-unfused check then decide, as for every family."""
    def refuse(why: str) -> UnsupportedArchitecture:
        return UnsupportedArchitecture(f"model type {model_type!r} is not in Kiln's family table and {why}; "
                                       f"supported families: {supported()}")

    if model_type is None or config is None:
        raise refuse("its config could not be read")
    if config.get("is_encoder_decoder"):
        raise refuse("it is an encoder-decoder model (Kiln compiles decoder-only language models)")
    names = {key: (key, *OLD_CONFIG_NAMES.get(key, ())) if file_keys else (key,) for key in STANDARD_CONFIG_KEYS}
    missing = [k for k in STANDARD_CONFIG_KEYS if not any(isinstance(config.get(n), int) for n in names[k])]
    if missing:
        raise refuse(f"its config has no {', '.join(missing)} (a row in compiler/families.py says where it keeps "
                     "them)")
    others = sorted(set(config.get("layer_types") or ()) - ATTENTION_LAYER_TYPES)
    if others:
        raise refuse(f"its layers of type {', '.join(others)} hold no KV cache (only attention layers export)")
    rotary = "rope_parameters" in config or "rope_theta" in config
    return Family(model_type, positions="rotary" if rotary else "learned",
                  notes="not in the table: compiled through transformers' attention interface")


def _check_standard_attention(model_type: str) -> None:
    """A generic family's model class must route attention through AttentionInterface (so the export
    traces Kiln's grouped attention) and keep its KV in transformers' Cache classes."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    model_class = getattr(transformers, name, None) if name else None
    if model_class is None:
        raise UnsupportedArchitecture(f"model type {model_type!r} is not in Kiln's family table and transformers "
                                      f"{transformers.__version__} has no causal language model for it")
    if not getattr(model_class, "_supports_attention_backend", False):
        raise UnsupportedArchitecture(
            f"model type {model_type!r} is not in Kiln's family table and {name} does not go through "
            "transformers' attention interface; it needs a row in compiler/families.py (attention=\"eager\") "
            f"and a tiny model to validate it; supported families: {supported()}")


@dataclass(frozen=True)
class Shapes:
    """What the graph interface needs to know about a checkpoint."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    sliding_window: int | None = None  # the widest attention span of a sliding layer, in slots
    # Each layer's span: None where it attends to everything (Gemma 2 alternates the two kinds).
    layer_windows: tuple[int | None, ...] = ()


def shapes_of(config: object) -> Shapes:
    family = family_for(config)
    windows = layer_windows(config)
    heads = config.num_attention_heads
    kv_heads = family.cache_heads(config) if family.cache_heads else \
        next(getattr(config, a) for a in family.kv_heads_attrs if getattr(config, a, None))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Shapes(
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_positions=config.max_position_embeddings,
        sliding_window=max((w for w in windows if w), default=None),
        layer_windows=windows,
    )


def layer_windows(config: object) -> tuple[int | None, ...]:
    """transformers' layer_types ("sliding_attention" / "full_attention") where the config has them,
    else the config's sliding_window on every layer (or on none)."""
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    if types:
        return tuple(window if kind == "sliding_attention" else None for kind in types)
    return (window,) * config.num_hidden_layers
