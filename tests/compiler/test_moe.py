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
    """The op's experts are SwiGLUs (clamped or not): a Mixtral whose experts gate with GELU is refused
    after loading, in one line that says so, not exported wrong."""
    import torch
    import transformers

    from tests.conftest import EOS, VOCAB

    config = transformers.MixtralConfig(vocab_size=VOCAB, bos_token_id=EOS, eos_token_id=EOS, hidden_size=64,
                                        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                                        max_position_embeddings=256, hidden_act="gelu")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    (tmp_path / "model.safetensors").unlink()  # refused before a weight is read: none is needed
    with pytest.raises(UnsupportedArchitecture, match=r"its mixture-of-experts layers cannot be exported as ONNX "
                                                      r"Runtime's MoE op \(a gate that is not a SwiGLU") as refused:
        load_checkpoint(ModelSpec(source=str(tmp_path)))
    assert "\n" not in str(refused.value)


def test_phimoe_with_longrope_compiles_and_each_row_scales_by_its_own_positions(tmp_path):
    """Phi-3.5-MoE's longrope multiplies cos and sin by long_mscale once the positions pass
    original_max_position_embeddings (a Python branch in transformers, given a traceable form at export):
    prompts on both sides of it, and one that crosses it while it decodes, give eager's greedy tokens
    alone, and the same batched (each row's own positions pick its scale)."""
    import torch
    import transformers

    from compiler.pipeline import compile_recipe
    from runtime.sampling import SamplingParams
    from tests.conftest import EOS, VOCAB, build_tokenizer, write_recipe

    config = transformers.PhimoeConfig(
        vocab_size=VOCAB, bos_token_id=EOS, eos_token_id=EOS, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_local_experts=4,
        intermediate_size=64, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "long_factor": [1.0 + i / 4 for i in range(8)],
            "short_factor": [1.0 + i / 40 for i in range(8)], "original_max_position_embeddings": 16,
            "long_mscale": 1.6, "short_mscale": 0.7})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / "checkpoint")
    build_tokenizer(tmp_path / "checkpoint")
    artifact = compile_recipe(write_recipe(tmp_path / "r.yaml", tmp_path / "checkpoint", name="phimoe-longrope"),
                              tmp_path / "out")
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 200, size=n)] for n in (6, 12, 24)]  # short, crossing, long
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    generator = Generator.load(artifact, "cpu-fp32")
    alone = [generator.generate([p], params)[0].token_ids for p in prompts]
    eager = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
            eager.append(out[0, len(prompt):].tolist())
    assert alone == eager
    assert [r.token_ids for r in generator.generate(prompts, params)] == alone


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


ROUTING = dict(k=2, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
               normalize_routing_weights=1)


def random_experts(seed: int, tokens: int, hidden: int, inter: int, experts: int) -> tuple[np.ndarray, ...]:
    """Tokens, router logits and SwiGLU experts' fc1 [experts, 2 inter, hidden] and fc2 [experts, hidden, inter]."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32)
    fc1 = (rng.standard_normal((experts, 2 * inter, hidden)) * 0.2).astype(np.float32)
    fc2 = (rng.standard_normal((experts, hidden, inter)) * 0.2).astype(np.float32)
    return x, logits, fc1, fc2


def experts_session(node, weights: dict[str, np.ndarray]):
    """One MoE or QMoE node over inputs x and r in an ONNX Runtime CPU session, its weights initializers."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                              for n in ("x", "r")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(a, n) for n, a in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_experts_are_what_onnx_runtime_reads_back(bits):
    """QMoE's codes and scales (compiler/quantize.py) against the MoE op over the same weights
    dequantized in numpy: the layout (4-bit pairs, blocks along K) is the one ONNX Runtime reads. 8-bit
    experts run with int8 activations (the op has no fp32 8-bit kernel), so they agree within those."""
    from onnx import helper

    from compiler.quantize import _expert_blocks

    block = 32
    x, logits, fc1, fc2 = random_experts(0, tokens=7, hidden=64, inter=96, experts=4)
    blocks = {name: _expert_blocks(w, bits, block) for name, w in (("fc1", fc1), ("fc2", fc2))}

    def dequantized(codes, scales):
        if bits == 4:
            codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1)
        levels = codes.astype(np.float32) - 2 ** (bits - 1)
        return (levels.reshape(*scales.shape, block) * scales[..., None]).reshape(levels.shape)

    assert np.abs(dequantized(*blocks["fc1"]) - fc1).max() <= np.abs(fc1).max() / (2 ** (bits - 1) - 1)

    def run(node, weights):
        return experts_session(node, weights).run(None, {"x": x, "r": logits})[0]

    reference = run(helper.make_node("MoE", ["x", "r", "w1", "", "w2"], ["y"], domain="com.microsoft", **ROUTING),
                    {"w1": dequantized(*blocks["fc1"]), "w2": dequantized(*blocks["fc2"])})
    quantized = run(helper.make_node("QMoE", ["x", "r", "q1", "s1", "", "q2", "s2"], ["y"], domain="com.microsoft",
                                     expert_weight_bits=bits, block_size=block, accuracy_level=0, **ROUTING),
                    {"q1": blocks["fc1"][0], "s1": blocks["fc1"][1], "q2": blocks["fc2"][0], "s2": blocks["fc2"][1]})
    tolerance = 1e-5 if bits == 4 else 0.03 * np.abs(reference).max()
    assert np.abs(quantized - reference).max() <= tolerance


def test_the_moe_op_gives_a_token_alone_in_its_expert_other_numbers():
    """Why an fp32 MoE graph's prompts of different lengths prefill row by row (compiler/optimize.py,
    _kernel_graph_interface): ONNX Runtime's MoE op runs each expert's tokens as one MLAS SGEMM, whose
    one-row case (M == 1) sums in another order, so a token that is its experts' only one gets other
    numbers than beside a twin (two rows routed alike). QMoE (8- or 4-bit experts, int8 activations, as
    Kiln compiles it) gives each token its numbers alone, in twos or among all. Should the MoE op stop
    differing, those prompts may prefill in one step again."""
    import platform

    from onnx import helper

    from compiler.quantize import _expert_blocks

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("MLAS's one-row SGEMM is an x86-64 kernel")
    tokens, block = 12, 32
    x, logits, fc1, fc2 = random_experts(1, tokens=tokens, hidden=64, inter=32, experts=4)
    nodes = {"MoE": (helper.make_node("MoE", ["x", "r", "w1", "", "w2"], ["y"], domain="com.microsoft", **ROUTING),
                     {"w1": fc1, "w2": fc2})}
    for bits in (8, 4):
        (q1, s1), (q2, s2) = _expert_blocks(fc1, bits, block), _expert_blocks(fc2, bits, block)
        nodes[f"QMoE {bits}-bit"] = (
            helper.make_node("QMoE", ["x", "r", "q1", "s1", "", "q2", "s2"], ["y"], domain="com.microsoft",
                             expert_weight_bits=bits, block_size=block, accuracy_level=4, **ROUTING),
            {"q1": q1, "s1": s1, "q2": q2, "s2": s2})
    for op, (node, weights) in nodes.items():
        session = experts_session(node, weights)
        together = session.run(None, {"x": x, "r": logits})[0]
        alone = [session.run(None, {"x": x[[t]], "r": logits[[t]]})[0][0] for t in range(tokens)]
        twins = [session.run(None, {"x": x[[t, t]], "r": logits[[t, t]]})[0][0] for t in range(tokens)]
        # every expert takes two tokens or more in both: the same numbers
        assert all(np.array_equal(twin, together[t]) for t, twin in enumerate(twins)), op
        alike = [np.array_equal(one, twin) for one, twin in zip(alone, twins, strict=True)]
        assert all(alike) != (op == "MoE"), op


def test_int8_and_int4_variants_run_their_experts_as_qmoe(tiny_checkpoints, tmp_path):
    from compiler.pipeline import compile_recipe

    recipe = tmp_path / "quantized.yaml"
    recipe.write_text(f'name: quantized\nmodel: {{source: "{tiny_checkpoints["mixtral"]}"}}\n'
                      "export: {opset: 18, max_context: 128, logits: last}\nvariants:\n"
                      "  - {name: cpu-int8, target: onnxruntime, quantize: {mode: int8-dynamic}}\n"
                      "  - {name: cpu-int4, target: onnxruntime, quantize: {mode: int4}}\n")
    artifact = compile_recipe(recipe, tmp_path / "quantized")  # the recipe's accuracy gates held
    for variant in ("cpu-int8", "cpu-int4"):
        counts = op_counts(artifact / "variants" / variant / "model.onnx")
        assert counts["QMoE"] == 2 and counts["MoE"] == 0
        generator = Generator.load(artifact, variant, max_batch_size=8)
        prompt_ids = [generator.encode(p) for p in PROMPTS]
        batched = generator.generate(prompt_ids, SamplingParams(max_new_tokens=12))
        alone = [generator.generate([p], SamplingParams(max_new_tokens=12))[0] for p in prompt_ids]
        assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
