"""The model-family table: every difference between supported families, as data.

Keyed by the checkpoint config's `model_type` (GGUF-loaded configs carry no `architectures`, so the
model type is the key that every source has). Adding a family is one entry here plus its tiny-model
config in tests/conftest.py; tests/compiler/test_families.py fails until both exist.

The export itself is family-independent: it drives the transformers model through its Cache
classes, so what differs per family is only how to read the shapes the graph interface needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UnsupportedArchitecture


@dataclass(frozen=True)
class Family:
    name: str
    # "rotary" positions extend to any length the recipe asks for (within the config's limit);
    # "learned" positions are a table, so max_context can never exceed it.
    positions: str
    # Config attributes, in order of preference, that give the number of KV heads.
    kv_heads_attrs: tuple[str, ...] = ("num_key_value_heads", "num_attention_heads")
    # The transformers attention implementation the export traces (see compiler/load.py): "grouped"
    # is compiler/attention.py, for families whose attention goes through AttentionInterface with the
    # standard (module, query, key, value, mask, scaling) call; others keep transformers' "eager".
    attention: str = "grouped"
    notes: str = ""


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama", positions="rotary", notes="SmolLM2, TinyLlama, Llama 2/3; GQA"),
    "mistral": Family("Mistral", positions="rotary", notes="GQA, sliding window"),
    "qwen2": Family("Qwen2", positions="rotary", notes="GQA, QKV bias"),
    # GPT-2: fused c_attn Conv1D, learned position table, LayerNorm + GELU; multi-head KV.
    "gpt2": Family("GPT-2", positions="learned", kv_heads_attrs=("n_head",), attention="eager"),
}


def supported() -> str:
    return ", ".join(f"{f.name} ({key})" for key, f in FAMILIES.items())


def family_for(config: object) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedArchitecture(
            f"model type {model_type!r} is not supported; supported families: {supported()}"
        )
    return FAMILIES[model_type]


@dataclass(frozen=True)
class Shapes:
    """What the graph interface needs to know about a checkpoint."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    sliding_window: int | None = None  # attention span in slots (Mistral); None attends to everything


def shapes_of(config: object) -> Shapes:
    family = family_for(config)
    heads = config.num_attention_heads
    kv_heads = next(getattr(config, a) for a in family.kv_heads_attrs if getattr(config, a, None))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Shapes(
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=config.vocab_size,
        max_positions=config.max_position_embeddings,
        sliding_window=getattr(config, "sliding_window", None) or None,
    )
