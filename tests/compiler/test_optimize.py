"""The optimize stage: fusion counts pinned per family, fused graphs checked against unfused ones
under ONNX Runtime, the shared-buffer KV interface, and the TensorRT graph check."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from compiler.fusions import group_query_attention
from compiler.graph import OnnxArtifact
from compiler.optimize import compare_graphs, optimize
from compiler.tensorrt_check import TensorRTIncompatible, check_tensorrt_graph
from runtime.artifact import Artifact
from runtime.backends.onnxruntime import OnnxRuntimeBackend

# {family: {rule: count}} on the tiny models of tests/conftest.py (2 layers each)
ROTARY = {"group_query_attention": 2, "rms_normalization": 5, "skip_rms_normalization": 4, "rotary_embedding": 4,
          "skip_layer_normalization": 0, "gelu": 0}
QK_NORM = {**ROTARY, "rms_normalization": 9}  # two more RMSNorms a layer, on q and k


def layer_norm(skip: int, gelu: int) -> dict[str, int]:
    """A LayerNorm family: no RMSNorm; residual Add + LayerNorm pairs, and GELUs in the forms matched."""
    return {**ROTARY, "rms_normalization": 0, "skip_rms_normalization": 0, "skip_layer_normalization": skip,
            "gelu": gelu}


EXPECTED_FUSIONS = {
    "llama": ROTARY, "mistral": ROTARY, "qwen2": ROTARY, "phi3": ROTARY, "granite": ROTARY,
    "gemma": {**ROTARY, "gelu": 2},  # GeGLU: the tanh GELU is FastGelu
    "qwen3": QK_NORM, "gemma2": {**QK_NORM, "gelu": 2},  # Gemma 2: pre- and post-norms around attention and MLP
    "olmo2": {**QK_NORM, "skip_rms_normalization": 1},  # post-norms: the residual Add comes after the norm
    # Parallel attention + MLP share one norm a layer (Phi, GPT-NeoX, Falcon); OLMo's LayerNorm has no
    # weight and no bias; StableLM's MLP is SiLU-gated.
    "phi": layer_norm(2, 2), "gpt_neox": layer_norm(2, 2), "falcon": layer_norm(2, 2), "olmo": layer_norm(4, 0),
    "stablelm": layer_norm(4, 0), "starcoder2": layer_norm(4, 2),
    "gpt2": {**layer_norm(5, 2), "rotary_embedding": 0},  # the first pair: token + position embeddings, ln_1
    "mixtral": ROTARY,
    # Mixtures of experts without a row (the generic path): Qwen3-MoE and OLMoE norm q and k, PhiMoE is a
    # LayerNorm family. GPT-OSS's attention sinks keep its attention unfused (no GroupQueryAttention), and
    # its rotation (the halves cos/sin-mixed, then concatenated) is not the rotate_half form the rule matches.
    "qwen2_moe": ROTARY, "qwen3_moe": QK_NORM, "olmoe": QK_NORM, "phimoe": layer_norm(4, 0),
    "gpt_oss": {**ROTARY, "group_query_attention": 0, "rotary_embedding": 0},
}

# MatMuls pack_matmuls removes (2 layers): q/k/v into one and gate/up into one is 3 a layer; Phi's
# parallel attention and MLP read one norm, so q/k/v and fc1 pack (3); Starcoder2 has one MLP input
# projection (2); GPT-NeoX and Falcon fuse q/k/v themselves and their parallel attention and MLP
# read one norm (1); Phi-3 and GPT-2 have nothing left to pack; a mixture of experts' experts are one MoE
# node a layer, so only q/k/v pack (2).
MIXTURES_OF_EXPERTS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "gpt_oss")
EXPECTED_PACKED = {family: 6 for family in EXPECTED_FUSIONS} | {"starcoder2": 4, "gpt_neox": 2, "falcon": 2,
                                                               "phi3": 0, "gpt2": 0} | {
    family: 4 for family in MIXTURES_OF_EXPERTS}
# Layers whose rotations rotary_in_attention moves into GroupQueryAttention (after packing): not
# partial rotations (Phi, GPT-NeoX, StableLM, Falcon's tiny config), nor Qwen3's or Qwen3-MoE's, whose
# rotations read their per-head q/k norms through a Reshape, nor GPT-2's learned positions, nor GPT-OSS's
# (no GroupQueryAttention).
EXPECTED_FOLDED = {family: 2 for family in EXPECTED_FUSIONS} | {
    family: 0 for family in ("phi", "gpt_neox", "stablelm", "falcon", "qwen3", "gpt2", "qwen3_moe", "gpt_oss")}


def _exported(tiny_artifacts, tiny_checkpoints, family) -> OnnxArtifact:
    """The unfused fp32 graph of a tiny artifact, as the export stage hands it to optimize."""
    from transformers import AutoConfig

    from compiler.families import shapes_of

    entry = Artifact.open(tiny_artifacts[family]).variant("cpu-fp32-unfused")
    model = tiny_artifacts[family] / entry.model
    shapes = shapes_of(AutoConfig.from_pretrained(tiny_checkpoints[family]))
    return OnnxArtifact(model.parent, entry.document["interface"], shapes, 0, [model.name])


def test_fusion_counts_and_interface(tiny_artifacts, family):
    manifest = json.loads((tiny_artifacts[family] / "manifest.json").read_text())
    fused = manifest["variants"]["cpu-fp32"]
    assert fused["fusions"] == {**EXPECTED_FUSIONS[family], "pack_matmuls": EXPECTED_PACKED[family],
                                "rotary_in_attention": EXPECTED_FOLDED[family]}
    # A rule that matched nothing says why, in the manifest and the compile log.
    assert set(fused["fusions_not_applied"]) == {rule for rule, count in fused["fusions"].items() if count == 0}
    if fused["fusions"]["rms_normalization"] == 0:
        assert "no RMSNorm" in fused["fusions_not_applied"]["rms_normalization"]
    graph_ops = {n.op_type for n in onnx.load(str(tiny_artifacts[family] / fused["model"])).graph.node}
    assert ("SkipLayerNormalization" in graph_ops) == bool(fused["fusions"]["skip_layer_normalization"])
    # Where attention stays unfused (GPT-OSS), the graph concatenates past and present as the unfused one does.
    attention_fused = bool(EXPECTED_FUSIONS[family]["group_query_attention"])
    assert fused["interface"]["kv_sharing"] == ("shared-buffer" if attention_fused else "none")
    assert fused["node_count"] < manifest["variants"]["cpu-fp32-unfused"]["node_count"]
    graph = onnx.load(str(tiny_artifacts[family] / fused["model"]))
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("GroupQueryAttention") == fused["interface"]["layers"] * attention_fused
    # A layer's experts are one com.microsoft.MoE node (compiler/moe.py): no loop over experts or tokens.
    assert ops.count("MoE") == 2 * (family in MIXTURES_OF_EXPERTS)
    assert ops.count("NonZero") == ops.count("Loop") == 0
    attention = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
    rotating = [any(a.name == "do_rotary" and a.i == 1 for a in n.attribute) for n in attention]
    if EXPECTED_FOLDED[family]:
        # The rotations are the op's own; the graph before the fold is kept for onnxruntime-genai.
        assert ops.count("RotaryEmbedding") == 0 and all(rotating)
        unfolded = onnx.load(str(tiny_artifacts[family] / fused["genai_model"]), load_external_data=False)
        assert [n.op_type for n in unfolded.graph.node].count("RotaryEmbedding") == \
            EXPECTED_FUSIONS[family]["rotary_embedding"]
        assert fused["genai_model"] in fused["files"]
    else:
        assert ops.count("RotaryEmbedding") == EXPECTED_FUSIONS[family]["rotary_embedding"] and not any(rotating)
        assert "genai_model" not in fused
    # the Concat cache is gone: no node copies past into present any more
    assert any(n.op_type == "Concat" and any(o.startswith("present.") for o in n.output)
               for n in graph.graph.node) != attention_fused
    report = json.loads((tiny_artifacts[family] / fused["report"]).read_text())
    assert report["optimize"]["check"]["max_rel_logit_error"] < 1e-4


def test_shared_buffer_is_written_in_place(tiny_artifacts):
    entry = Artifact.open(tiny_artifacts["llama"]).variant("cpu-fp32")
    backend = OnnxRuntimeBackend(tiny_artifacts["llama"] / entry.model, entry.interface)
    cache = backend.new_cache(2, 16)
    ids = np.array([[5, 6, 7], [0, 8, 9]])
    mask = np.array([[1, 1, 1], [0, 1, 1]])
    first, returned = backend.run(ids, mask, np.clip(mask.cumsum(-1) - 1, 0, None), cache)
    assert returned is cache  # same arrays, filled by ONNX Runtime
    assert np.abs(cache[0][:, :, :3]).sum() > 0 and not cache[0][:, :, 3:].any()
    kept = first.copy()
    mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
    backend.run(np.array([[3], [4]]), mask, mask.sum(-1, keepdims=True) - 1, cache)
    assert np.array_equal(first, kept)  # the next step must not write into logits already returned
    assert np.abs(cache[0][:, :, 3]).sum() > 0 and not cache[0][:, :, 4:].any()


def test_a_broken_fusion_fails_the_check(tiny_artifacts, tiny_checkpoints, tmp_path, monkeypatch):
    from compiler.errors import ExportMismatch

    exported = _exported(tiny_artifacts, tiny_checkpoints, "llama")
    monkeypatch.setattr(group_query_attention, "MASKED_SCORE", 0.0)  # pads no longer masked
    with pytest.raises(ExportMismatch, match="optimized graph disagrees with the unfused one"):
        optimize(exported, "onnxruntime", True, tmp_path / "broken")


def test_rotary_folds_into_attention_only_where_it_gives_the_same_numbers(tiny_artifacts, tiny_checkpoints,
                                                                         tmp_path, monkeypatch):
    """fold_rotary keeps a folded graph only when it agrees with the unfolded one (optimize.compare_graphs;
    an fp32 graph in both row layouts): a fold that rotates the wrong halves is dropped, with the reason."""
    import shutil

    from transformers import AutoConfig

    from compiler.families import shapes_of
    from compiler.fusions import rotary_in_attention
    from compiler.optimize import GENAI_MODEL_FILE, fold_rotary

    entry = Artifact.open(tiny_artifacts["llama"]).variant("cpu-fp32")
    variant = tiny_artifacts["llama"] / entry.model
    shapes = shapes_of(AutoConfig.from_pretrained(tiny_checkpoints["llama"]))

    def unfolded(name: str) -> OnnxArtifact:
        folder = tmp_path / name
        folder.mkdir()
        shutil.copyfile(variant.parent / GENAI_MODEL_FILE, folder / "model.onnx")
        shutil.copyfile(variant.parent / "model.onnx.data", folder / "model.onnx.data")
        return OnnxArtifact(folder, entry.document["interface"], shapes, 0, ["model.onnx", "model.onnx.data"])

    graph = unfolded("good")
    folded, count = fold_rotary(graph, tmp_path / "good-folded", exact=True)
    assert count == 2 and folded.files == ["model.onnx", "model.onnx.data", GENAI_MODEL_FILE]
    assert not graph.model_path.exists()  # moved beside the folded graph, over the same weights file

    set_int = rotary_in_attention._set_int
    monkeypatch.setattr(rotary_in_attention, "_set_int",
                        lambda node, name, value: set_int(node, name, 1 if name == "rotary_interleaved" else value))
    graph = unfolded("bad")
    kept, why = fold_rotary(graph, tmp_path / "bad-folded", exact=False)  # wrong in Kiln's layout too
    assert kept is graph and graph.model_path.exists() and not (tmp_path / "bad-folded").exists()
    assert why.startswith("the folded graph disagreed with the unfolded one")


def test_tensorrt_target_stays_standard_onnx(tiny_artifacts, tiny_checkpoints, family, tmp_path):
    """Every family's tensorrt-target graph passes the check against onnx-tensorrt's operator table
    (ops, domains, dtypes), and the fused onnxruntime graph is refused by the same check."""
    import onnx_ir as ir

    exported = _exported(tiny_artifacts, tiny_checkpoints, family)
    if family in MIXTURES_OF_EXPERTS:  # their experts are ONNX Runtime's MoE op; test_moe.py checks the dense form
        with pytest.raises(TensorRTIncompatible, match=r"com.microsoft::MoE .*compile with export.experts: dense"):
            optimize(exported, "tensorrt", True, tmp_path / "trt")
        return
    graph, report = optimize(exported, "tensorrt", True, tmp_path / "trt")
    assert report["rules"] == {} and report["tensorrt_check"]["unsupported"] == {}
    assert all(not n.domain for n in onnx.load(str(graph.model_path)).graph.node)
    fused = Artifact.open(tiny_artifacts[family]).variant("cpu-fp32")
    with pytest.raises(TensorRTIncompatible, match="com.microsoft::GroupQueryAttention .domain com.microsoft"):
        check_tensorrt_graph(ir.load(str(tiny_artifacts[family] / fused.model)))
    assert compare_graphs(exported, graph)["max_abs_logit_error"] == 0.0


@pytest.mark.parametrize("bits", [8, 4])
def test_a_kernels_graph_folds_the_swiglu_after_a_gate_up_projection_bit_for_bit(bits, tmp_path, monkeypatch):
    """MatMulNBits -> Split in halves -> silu(first) * second (pack_matmuls' gate/up, Sigmoid and Mul
    as exported) becomes one gated kernel node, whose outputs equal, bit for bit, the kernel node's
    followed by ONNX Runtime's Split, Sigmoid (QuickGelu once fused) and Mul; a half read by anything
    else is left alone."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from compiler import optimize as optimize_module
    from compiler.optimize import kernel_graph
    from runtime import cpu_kernels

    library = cpu_kernels.library()[0]
    if library is None:
        pytest.skip("Kiln's CPU kernels do not run on this machine")
    rng = np.random.default_rng(bits)
    k, half = 64, 48
    blocks, per_byte = k // 32, 8 // bits
    codes = rng.integers(0, 256, (2 * half, blocks, 32 // per_byte), dtype=np.uint8)
    scales = (rng.random(2 * half * blocks) * 0.05 + 0.01).astype(np.float32)
    nodes = [helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], name="gate_up", domain="com.microsoft",
                              K=k, N=2 * half, bits=bits, block_size=32, accuracy_level=4),
             helper.make_node("Split", ["y", "sizes"], ["g", "u"], name="split", axis=-1),
             helper.make_node("Sigmoid", ["g"], ["s"], name="sigmoid"),
             helper.make_node("Mul", ["g", "s"], ["silu"], name="silu"),
             helper.make_node("Mul", ["silu", "u"], ["out"], name="product")]
    initializers = [numpy_helper.from_array(codes, "B"), numpy_helper.from_array(scales, "S"),
                    numpy_helper.from_array(np.array([half, half], np.int64), "sizes")]
    graph = helper.make_graph(nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, "s", k])],
                              [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [1, "s", half])],
                              initializers)
    (tmp_path / "graph").mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                       helper.make_opsetid("com.microsoft", 1)]),
              str(tmp_path / "graph" / "model.onnx"))
    source = OnnxArtifact(tmp_path / "graph", {}, None, 0, ["model.onnx"])

    def run(folder):
        built, count = kernel_graph(source, folder)
        options = ort.SessionOptions()
        options.register_custom_ops_library(str(library))
        session = ort.InferenceSession(str(built.model_path), options, providers=["CPUExecutionProvider"])
        ops = [n.op_type for n in onnx.load(str(built.model_path)).graph.node]
        return [session.run(None, {"x": x})[0] for x in inputs], ops

    inputs = [rng.standard_normal((1, rows, k)).astype(np.float32) * 4 for rows in (1, 9, 70)]
    fused, fused_ops = run(tmp_path / "fused")
    assert fused_ops == [cpu_kernels.INT8_BLOCKS_OP if bits == 8 else cpu_kernels.INT4_BLOCKS_OP]
    monkeypatch.setattr(optimize_module, "_swiglu_after", lambda *args: None)
    unfused, unfused_ops = run(tmp_path / "unfused")
    assert unfused_ops[1:] == ["Split", "Sigmoid", "Mul", "Mul"]
    for a, b in zip(fused, unfused, strict=True):
        assert a.shape == b.shape and np.array_equal(a, b)
    monkeypatch.undo()

    # a half read by anything else (here the graph's caller): left as it is
    outputs = [*graph.output, onnx.helper.make_tensor_value_info("u", onnx.TensorProto.FLOAT, [1, "s", half])]
    graph = helper.make_graph(nodes, "g", list(graph.input), outputs, initializers)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                       helper.make_opsetid("com.microsoft", 1)]),
              str(tmp_path / "graph" / "model.onnx"))
    assert run(tmp_path / "also_read")[1][1:] == ["Split", "Sigmoid", "Mul", "Mul"]


def test_a_swiglu_after_an_fp32_matmul_the_op_refuses_is_still_folded(tmp_path):
    """The SwiGLU op reads any fp32 MatMul's output: where MatMulFp32 refuses the weights (an initializer
    that is also a graph input, which a caller may feed at run time), the MatMul stays ONNX's and the
    Split, Sigmoid and two Muls after it still become one ai.kiln::SwiGLU, bit for bit their numbers."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from compiler.optimize import kernel_graph
    from runtime import cpu_kernels

    library = cpu_kernels.library()[0]
    if library is None:
        pytest.skip("Kiln's CPU kernels do not run on this machine")
    rng = np.random.default_rng(7)
    k, half = 24, 40
    weights = rng.standard_normal((k, 2 * half)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="gate_up"),
             helper.make_node("Split", ["y", "sizes"], ["g", "u"], name="split", axis=-1),
             helper.make_node("Sigmoid", ["g"], ["s"], name="sigmoid"),
             helper.make_node("Mul", ["g", "s"], ["silu"], name="silu"),
             helper.make_node("Mul", ["silu", "u"], ["out"], name="product")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, "s", k]),
                     helper.make_tensor_value_info("W", onnx.TensorProto.FLOAT, [k, 2 * half])],
        [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, [1, "s", half])],
        [numpy_helper.from_array(weights, "W"), numpy_helper.from_array(np.array([half, half], np.int64), "sizes")])
    (tmp_path / "graph").mkdir()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
              str(tmp_path / "graph" / "model.onnx"))
    built, count = kernel_graph(OnnxArtifact(tmp_path / "graph", {}, None, 0, ["model.onnx"]), tmp_path / "kernels")
    kernels = onnx.load(str(built.model_path))
    assert count == 1 and [(n.domain, n.op_type) for n in kernels.graph.node] == [
        ("", "MatMul"), (cpu_kernels.DOMAIN, cpu_kernels.SWIGLU_OP)]
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    ours = ort.InferenceSession(str(built.model_path), options, providers=["CPUExecutionProvider"])
    onnx_runtime = ort.InferenceSession(str(tmp_path / "graph" / "model.onnx"), providers=["CPUExecutionProvider"])
    for rows in (1, 5, 33):
        x = rng.standard_normal((1, rows, k)).astype(np.float32)
        assert np.array_equal(ours.run(None, {"x": x})[0], onnx_runtime.run(None, {"x": x})[0])


def test_an_fp32_variant_runs_its_matmuls_attention_and_swiglu_in_kilns_kernels(tiny_artifacts, tiny_checkpoints,
                                                                                family, tmp_path):
    """Every family's fused fp32 variant ships a kernels' graph: each MatMul by fp32 weights as
    ai.kiln::MatMulFp32 (a tied LM head reading the embeddings itself, transB, its Transpose gone), each
    GroupQueryAttention the kernel takes (runtime/kernels/attention.c) as ai.kiln::GroupQueryAttention, one
    ai.kiln::SwiGLU for each packed gate/up MatMul's Split, Sigmoid and two Muls, and nothing else changed.
    Through a prefill and decode steps, in Kiln's layout and the left-padded one, it gives model.onnx's logits
    to fp32's rounding; with its MatMulFp32 nodes back as ONNX's MatMuls, bit for bit (the attention and
    SwiGLU kernels' numbers are ONNX Runtime's)."""
    from compiler.optimize import CHECK_PADS, CHECK_PROMPT, CHECK_STEPS, _fp32_matmul_weights, _greedy_steps
    from runtime import cpu_kernels
    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    folder = tiny_artifacts[family]
    entry = Artifact.open(folder).variant("cpu-fp32")
    graph = onnx.load(str(folder / entry.model), load_external_data=False)
    # A sliding window (Mistral, Starcoder2, Gemma 2) or a softcap (Gemma 2) stays ONNX Runtime's
    taken = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention" and not any(
        (a.name == "local_window_size" and a.i != -1) or (a.name == "softcap" and a.f != 0) for a in n.attribute)]
    readers, producers = {}, {output: node for node in graph.graph.node for output in node.output}
    for node in graph.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    initializers = {i.name: i for i in graph.graph.initializer}
    matmuls = [n for n in graph.graph.node if _fp32_matmul_weights(n, initializers, producers)]
    transposed = [producers[n.input[1]] for n in matmuls if n.input[1] not in initializers]
    swiglus = []  # (Split, Sigmoid, SiLU's Mul, the product's Mul) after a packed gate/up MatMul
    for matmul in matmuls:
        split = readers.get(matmul.output[0], [None])[0]
        sigmoid = next((r for r in readers.get(split.output[0], []) if r.op_type == "Sigmoid"), None) \
            if split is not None and split.op_type == "Split" else None
        if sigmoid is not None:  # (a Split of packed attention projections is not one)
            silu = readers[sigmoid.output[0]][0]
            swiglus.append((split, sigmoid, silu, readers[silu.output[0]][0]))
    library, why = cpu_kernels.library()
    if library is None:
        assert "kernel_model" not in entry
        pytest.skip(f"the kernels' graph is checked where Kiln's CPU kernels run: {why}")
    assert matmuls
    assert entry.kernel_model == "variants/cpu-fp32/model_kernels.onnx"
    assert f"variants/cpu-fp32/{cpu_kernels.KERNEL_DATA_FILE}" not in entry.files  # no packed weights
    every = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
    # each row as alone; not past ONNX Runtime's fp32 MoE op, whose numbers for a token depend on its neighbours
    moe = any(n.op_type == "MoE" for n in graph.graph.node)
    assert (entry.kernel_prefill == "batched") == (len(taken) == len(every) > 0 and not moe)
    kernels = onnx.load(str(folder / entry.kernel_model), load_external_data=False)
    ours = [(n.domain, n.op_type) for n in kernels.graph.node]
    assert ours.count((cpu_kernels.DOMAIN, cpu_kernels.ATTENTION_OP)) == len(taken)
    assert ours.count((cpu_kernels.DOMAIN, cpu_kernels.SWIGLU_OP)) == len(swiglus)
    assert ours.count((cpu_kernels.DOMAIN, cpu_kernels.FP32_MATMUL_OP)) == len(matmuls)
    replaced = [node for four in swiglus for node in four] + transposed
    assert [n for n in ours if n[0] != cpu_kernels.DOMAIN] == [
        (n.domain, n.op_type) for n in graph.graph.node if n not in taken + replaced + matmuls]

    undone = onnx.load(str(folder / entry.kernel_model), load_external_data=False)  # ONNX's MatMuls again
    nodes = list(undone.graph.node)
    undone.graph.ClearField("node")
    for node in nodes:
        if node.op_type != cpu_kernels.FP32_MATMUL_OP:
            undone.graph.node.append(node)
            continue
        weights = node.input[1]
        if any(a.name == "transB" and a.i for a in node.attribute):  # the Transpose back, just before
            undone.graph.node.append(onnx.helper.make_node("Transpose", [weights], [weights + ".T"]))
            weights += ".T"
        undone.graph.node.append(onnx.helper.make_node("MatMul", [node.input[0], weights], list(node.output)))
    onnx.save(undone, str(tmp_path / "model_undone.onnx"))
    shutil.copy(folder / "variants" / "cpu-fp32" / "model.onnx.data", tmp_path)  # ONNX Runtime follows no link out

    exported = _exported(tiny_artifacts, tiny_checkpoints, family)  # for the model's shapes
    reference = OnnxArtifact(folder / "variants" / "cpu-fp32", entry.document["interface"], exported.shapes, 0,
                             ["model.onnx"])
    steps = _greedy_steps(reference, seed=3)
    backends = [OnnxRuntimeBackend(reference.model_path, entry.interface),
                OnnxRuntimeBackend(folder / entry.kernel_model, entry.interface, kernels=library),
                OnnxRuntimeBackend(tmp_path / "model_undone.onnx", entry.interface, kernels=library)]
    # each layout against model.onnx in the same layout: rows from slot 0 where the graph's attention reads
    # each row's length from its mask (GroupQueryAttention), not where it stays unfused (GPT-OSS)
    for front_aligned in sorted({backends[0].front_aligned, False}, reverse=True):
        caches = []
        for backend in backends:
            backend.front_aligned = front_aligned
            caches.append(backend.new_cache(len(CHECK_PADS), CHECK_PROMPT + CHECK_STEPS))
        for ids, mask, positions, _ in steps:
            logits = []
            for number, backend in enumerate(backends):
                got, caches[number] = backend.run(ids, mask, positions, caches[number])
                logits.append(got[mask[:, -got.shape[1]:].astype(bool)])
            expected, ours_, undone_ = logits
            assert np.array_equal(undone_, expected)
            np.testing.assert_allclose(ours_, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    for backend in backends:
        backend.close()


def test_only_attention_the_kernel_takes_moves_to_it():
    """Nodes the op would refuse when the session loads stay com.microsoft's: a refusal there would cost
    the variant its whole kernels' graph."""
    from onnx import TensorProto, helper

    from compiler.optimize import _kernel_attention

    def node_in_graph(heads=8, kv_heads=2, head_size=64, outputs=3, **attributes):
        past = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", kv_heads, "p", head_size]) for n in ("pk", "pv")]
        node = helper.make_node("GroupQueryAttention", ["q", "", "", "pk", "pv", "s", "t"],
                                ["o", "k", "v", ""][:outputs], domain="com.microsoft", num_heads=heads,
                                kv_num_heads=kv_heads, **attributes)
        return node, helper.make_graph([node], "g", past, [])

    assert _kernel_attention(*node_in_graph())
    assert not _kernel_attention(*node_in_graph(heads=128, kv_heads=1))  # 128 query heads a kv head: over 64
    assert not _kernel_attention(*node_in_graph(outputs=4))  # an output_qk slot, even empty
    assert not _kernel_attention(*node_in_graph(head_size=40))  # not a multiple of 16
    assert not _kernel_attention(*node_in_graph(softcap=30.0))
    assert not _kernel_attention(*node_in_graph(local_window_size=4096))
    assert not _kernel_attention(*node_in_graph(smooth_softmax=1))
