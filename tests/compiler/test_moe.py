"""Mixture-of-experts layers (compiler/moe.py): one ONNX Runtime MoE node a layer, equal to the same
experts run densely in standard ONNX ops and to eager transformers; experts the op cannot compute are
refused in one line; the memory plan counts every expert."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest

from compiler.errors import UnsupportedArchitecture
from compiler.load import load_checkpoint
from compiler.recipe import ModelSpec
from runtime.generator import Generator
from runtime.sampling import SamplingParams
from tests.conftest import FP32_VARIANT, build_tokenizer
from tests.runtime.test_generator import PROMPTS, _eager_greedy


def op_counts(model: Path) -> collections.Counter:
    import onnx

    return collections.Counter(node.op_type for node in onnx.load(str(model), load_external_data=False).graph.node)


def test_mixtral_experts_are_one_moe_node_a_layer_and_match_eager(tiny_artifacts, tiny_checkpoints):
    artifact = tiny_artifacts["mixtral"]
    counts = op_counts(artifact / "variants" / "cpu-fp32" / "model.onnx")
    assert counts["MoE"] == 2 and counts["NonZero"] == counts["Loop"] == 0
    generator = Generator.load(artifact, max_batch_size=8)
    prompt_ids = [generator.encode(p) for p in PROMPTS]
    batched = generator.generate(prompt_ids, SamplingParams(max_new_tokens=16))
    alone = [generator.generate([p], SamplingParams(max_new_tokens=16))[0] for p in prompt_ids]
    eager = _eager_greedy(tiny_checkpoints["mixtral"], prompt_ids, 16, eos=0)
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone] == eager


def test_the_moe_op_equals_every_expert_run_densely(tiny_artifacts, tiny_checkpoints, tmp_path):
    """export.experts: dense (every expert over every token, standard ops: the unfused form) against the
    fused op, both in ONNX Runtime: the same greedy tokens and log-probabilities."""
    from compiler.pipeline import compile_recipe

    recipe = tmp_path / "dense.yaml"
    recipe.write_text(f'name: dense\nmodel: {{source: "{tiny_checkpoints["mixtral"]}"}}\n'
                      "export: {opset: 18, max_context: 128, logits: last, experts: dense}\n"
                      "variants:\n" + FP32_VARIANT)
    dense = compile_recipe(recipe, tmp_path / "dense")
    counts = op_counts(dense / "variants" / "cpu-fp32" / "model.onnx")
    assert counts["MoE"] == 0 and counts["Einsum"] == 4
    import onnx_ir as ir

    from compiler.tensorrt_check import unsupported_ops

    left = unsupported_ops(ir.load(str(dense / "variants" / "cpu-fp32" / "model.onnx")))
    assert "Einsum" not in left and "ScatterElements" not in left and not any("MoE" in op for op in left)
    answers = {}
    for name, artifact in (("dense", dense), ("moe", tiny_artifacts["mixtral"])):
        generator = Generator.load(artifact, max_batch_size=8)
        answers[name] = generator.generate([generator.encode(p) for p in PROMPTS],
                                           SamplingParams(max_new_tokens=12, logprobs=0))
    for fused, unfused in zip(answers["moe"], answers["dense"], strict=True):
        assert fused.token_ids == unfused.token_ids
        np.testing.assert_allclose([t.logprob for t in fused.logprobs], [t.logprob for t in unfused.logprobs],
                                   atol=1e-4)


def test_experts_the_moe_op_cannot_compute_are_refused_in_one_line(tmp_path):
    """GPT-OSS's experts have biases, are stored transposed and gate with a clamped SwiGLU of their own."""
    import torch
    import transformers

    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                       layer_types=["sliding_attention", "full_attention"], vocab_size=100,
                                       max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    with pytest.raises(UnsupportedArchitecture, match=r"its mixture-of-experts layers cannot be exported as ONNX "
                                                      r"Runtime's MoE op \(.*experts with biases") as refused:
        load_checkpoint(ModelSpec(source=str(tmp_path)))
    assert "\n" not in str(refused.value)


def test_the_plan_from_a_config_counts_every_expert(tiny_checkpoints):
    """kiln plan --config and the compile's memory prediction: the weights of all experts are resident."""
    import torch
    import transformers

    from runtime.memory import config_interface

    folder = tiny_checkpoints["mixtral"]
    config = json.loads((folder / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    assert config_interface(config, "fp32")[1] == pytest.approx(4 * parameters, rel=0.01)
