"""The family table: every entry is tested, and what is outside it and the generic path cannot take
(tests/compiler/test_generic_family.py) is refused with the list."""

from __future__ import annotations

import json

import pytest

from compiler.errors import CheckpointError, UnsupportedArchitecture
from compiler.families import FAMILIES, family_for, shapes_of
from compiler.load import load_checkpoint
from compiler.recipe import ModelSpec
from tests.conftest import FAMILY_CONFIGS, GENERIC_CONFIGS, REFUSED_CONFIGS, TINY_CONFIGS, build_tiny_checkpoint


def test_every_family_has_a_tiny_model_test():
    # Like Optimum's test_all_models_tested: a family added to the table without a tiny config
    # (and so without export and generation tests) fails here, and so does a tiny config without a row.
    assert {k for k, f in FAMILIES.items() if f.refused is None} == set(TINY_CONFIGS)
    assert {k for k, f in FAMILIES.items() if f.refused} == set(REFUSED_CONFIGS)
    assert not set(GENERIC_CONFIGS) & set(FAMILIES)  # those go through the generic path


def test_refused_family_says_why_before_loading_weights(tmp_path):
    folder = build_tiny_checkpoint("bloom", tmp_path / "bloom")
    with pytest.raises(UnsupportedArchitecture, match=r"'bloom' \(BLOOM\) is refused: its attention adds an ALiBi"):
        load_checkpoint(ModelSpec(source=str(folder)))


@pytest.mark.parametrize("model_type", ["bloom", "mpt"])
def test_alibi_position_bias_is_refused_by_name_before_loading_weights(model_type, tmp_path):
    folder = build_tiny_checkpoint(model_type, tmp_path / model_type)
    with pytest.raises(UnsupportedArchitecture, match=rf"'{model_type}' \(.*\) is refused: its attention adds an "
                                                      "ALiBi position bias"):
        load_checkpoint(ModelSpec(source=str(folder)))


def test_falcon_with_alibi_compiles_and_generates_as_transformers(tmp_path):
    """Falcon's ALiBi (Falcon-RW): the bias built in the graph from the attention mask, its bfloat16
    arithmetic widened to fp32 and rounded back (ONNX Runtime's CPU provider has no bfloat16 Mul), validated
    against eager by the compile; greedy tokens batched with left padding equal eager transformers'."""
    import transformers

    from compiler.pipeline import compile_recipe
    from runtime.generator import Generator
    from runtime.sampling import SamplingParams
    from tests.conftest import EOS, VOCAB, build_tokenizer, write_recipe
    from tests.runtime.test_generator import PROMPTS, _eager_greedy

    config = transformers.FalconConfig(vocab_size=VOCAB, bos_token_id=EOS, eos_token_id=EOS, hidden_size=64,
                                       num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                                       new_decoder_architecture=True, max_position_embeddings=256, alibi=True)
    transformers.set_seed(0)
    checkpoint = tmp_path / "checkpoint"
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(checkpoint)
    build_tokenizer(checkpoint)
    artifact = compile_recipe(write_recipe(tmp_path / "recipe.yaml", checkpoint, name="falcon-alibi"), tmp_path / "out")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["export"]["validation"]["max_abs_logit_error"] < 1e-5
    generator = Generator.load(artifact, max_batch_size=8)
    prompt_ids = [generator.encode(p) for p in PROMPTS]
    batched = generator.generate(prompt_ids, SamplingParams(max_new_tokens=16))
    assert [r.token_ids for r in batched] == _eager_greedy(checkpoint, prompt_ids, 16, eos=0)


def test_shapes_read_from_each_family(tiny_checkpoints, family):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_checkpoints[family])
    shapes = shapes_of(config)
    kwargs = FAMILY_CONFIGS[family][1]
    expected_kv = 4 if family == "falcon" else kwargs.get("num_key_value_heads", 4)  # Falcon caches every head
    assert (shapes.layers, shapes.kv_heads, shapes.head_dim) == (2, expected_kv, 16)
    if family in ("gemma2", "gpt_oss"):  # alternating layers: sliding, then full
        assert shapes.layer_windows == (8, None)


def test_unknown_model_type_lists_supported():
    class Config:
        model_type = "bert"

    with pytest.raises(UnsupportedArchitecture,
                       match=r"'bert' is not in Kiln's family table .*; supported families: Llama \(llama\)"):
        family_for(Config())


def test_unsupported_folder_is_refused_before_loading_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(CheckpointError, match="not a causal language model; supported families: Llama"):
        load_checkpoint(ModelSpec(source=str(tmp_path)))


def test_supported_type_but_not_a_causal_lm(tiny_checkpoints, tmp_path):
    config = json.loads((tiny_checkpoints["llama"] / "config.json").read_text())
    config["architectures"] = ["LlamaForSequenceClassification"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="LlamaForSequenceClassification is not a causal language model"):
        load_checkpoint(ModelSpec(source=str(tmp_path)))


def test_causal_lm_of_a_family_we_do_not_support(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(UnsupportedArchitecture,
                       match="'mamba' is not in Kiln's family table and its config has no num_attention_heads"):
        load_checkpoint(ModelSpec(source=str(tmp_path)))
