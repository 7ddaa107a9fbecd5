"""The family table: every entry is tested, and anything outside it is refused with the list."""

from __future__ import annotations

import json

import pytest

from compiler.errors import CheckpointError, UnsupportedArchitecture
from compiler.families import FAMILIES, family_for, shapes_of
from compiler.load import load_checkpoint
from compiler.recipe import ModelSpec
from tests.conftest import TINY_CONFIGS


def test_every_family_has_a_tiny_model_test():
    # Like Optimum's test_all_models_tested: a family added to the table without a tiny config
    # (and so without export and generation tests) fails here.
    assert set(FAMILIES) == set(TINY_CONFIGS)


def test_shapes_read_from_each_family(tiny_checkpoints, family):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_checkpoints[family])
    shapes = shapes_of(config)
    expected_kv = {"llama": 2, "mistral": 1, "qwen2": 2, "gpt2": 4}[family]
    assert (shapes.layers, shapes.kv_heads, shapes.head_dim) == (2, expected_kv, 16)


def test_unknown_model_type_lists_supported():
    class Config:
        model_type = "bert"

    with pytest.raises(UnsupportedArchitecture, match=r"'bert' is not supported; supported families: Llama \(llama\)"):
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
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}))
    with pytest.raises(UnsupportedArchitecture, match="'gpt_neox' is not supported; supported families"):
        load_checkpoint(ModelSpec(source=str(tmp_path)))
