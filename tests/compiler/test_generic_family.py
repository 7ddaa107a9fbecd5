"""A model type outside the family table compiles through the generic path when its transformers
model is of the standard kind, and is refused, naming what is missing, when it is not."""

from __future__ import annotations

import json

import pytest

from compiler.errors import UnsupportedArchitecture
from compiler.families import FAMILIES, family_for
from runtime.generator import Generator
from runtime.sampling import SamplingParams
from tests.conftest import GENERIC_CONFIGS, MOE_GENERIC_CONFIGS, build_tiny_checkpoint, write_recipe
from tests.runtime.test_generator import PROMPTS, _eager_greedy

# Helium's rotary is interleaved, which the rotary rule does not match (GroupQueryAttention then takes
# rotated q/k); its RMSNorm epsilon is 1e-8, which onnxscript's optimizer used to drop (no RMSNorm
# matched, and a zero embedding row gave NaN). SmolLM3 rotates every other layer only.
EXPECTED_FUSIONS = {
    "helium": {"rotary_embedding": 0, "group_query_attention": 2, "rms_normalization": 5, "skip_rms_normalization": 4},
    "smollm3": {"rotary_embedding": 2, "group_query_attention": 2, "rms_normalization": 5, "skip_rms_normalization": 4},
    "gptj": {"rotary_embedding": 0, "group_query_attention": 2, "skip_layer_normalization": 2, "gelu": 2},
    "gpt_bigcode": {"group_query_attention": 2, "skip_layer_normalization": 5, "gelu": 2},
}


# The mixtures of experts without a row run in every family-parametrized test instead (tests/conftest.py
# FAMILY_CONFIGS): their fusions, MoE nodes, compile and greedy tokens against eager among them.
@pytest.mark.parametrize("model_type", sorted(set(GENERIC_CONFIGS) - set(MOE_GENERIC_CONFIGS)))
def test_a_model_type_without_a_row_compiles_and_generates_as_transformers(model_type, tmp_path):
    from compiler.pipeline import compile_recipe

    assert model_type not in FAMILIES
    checkpoint = build_tiny_checkpoint(model_type, tmp_path / "checkpoint")
    artifact = compile_recipe(write_recipe(tmp_path / "recipe.yaml", checkpoint, name=model_type), tmp_path / "out")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["model"]["family"] == model_type
    fused = manifest["variants"]["cpu-fp32"]
    # validated against eager and against the unfused graph by the compile itself
    assert {rule: fused["fusions"][rule] for rule in EXPECTED_FUSIONS[model_type]} == EXPECTED_FUSIONS[model_type]
    generator = Generator.load(artifact, max_batch_size=8)
    # the last prompt holds token 0, whose embedding row is zero (padding_idx): an RMSNorm without its
    # epsilon turns it into NaN
    prompt_ids = [generator.encode(p) for p in PROMPTS] + [[5, 0, 7, 9]]
    batched = generator.generate(prompt_ids, SamplingParams(max_new_tokens=16))
    assert [r.token_ids for r in batched] == _eager_greedy(checkpoint, prompt_ids, 16, eos=0)


@pytest.mark.parametrize("model_type, sizes", [
    ("gptj", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    ("codegen", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    ("gpt_bigcode", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    ("ctrl", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
])
def test_a_config_that_names_its_sizes_the_old_way_is_read_through_its_attribute_map(model_type, sizes, tmp_path):
    """The config object answers transformers' names (attribute_map), which its config.json lacks; the
    check before loading (config.json alone) leaves them to it instead of refusing."""
    from transformers import AutoConfig

    from compiler.load import preflight
    from compiler.recipe import ModelSpec

    config = AutoConfig.for_model(model_type, **sizes)
    assert "num_hidden_layers" not in json.loads(config.to_json_string())  # the file says n_layer
    family = family_for(config)
    assert family.name == model_type and family.kv_heads_attrs[-1] == "num_attention_heads"
    config.save_pretrained(tmp_path)
    assert preflight(ModelSpec(source=str(tmp_path)), max_context=128) == 256


@pytest.mark.parametrize("model_type, overrides, why", [
    ("mamba", {}, "its config has no num_attention_heads"),
    ("lfm2", {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]}, "its layers of type conv hold no KV cache"),
    ("roformer", {"is_decoder": True}, "RoFormerForCausalLM does not go through transformers' attention interface"),
    ("t5", {}, "it is an encoder-decoder model"),
])
def test_a_model_type_the_generic_path_cannot_take_is_refused_with_what_is_missing(model_type, overrides, why):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **overrides)
    with pytest.raises(UnsupportedArchitecture, match=f"model type '{model_type}' is not in Kiln's family table") as e:
        family_for(config)
    assert why in str(e.value)
