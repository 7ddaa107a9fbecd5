"""Precision modes and accuracy gates, compiled for real on the tiny Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import onnx
import pytest

from compiler.accuracy import Inputs, failed_gates, greedy_match, perplexity
from compiler.errors import GateFailure
from compiler.pipeline import compile_recipe
from compiler.weights import weight_matmuls
from runtime.generator import Generator
from runtime.sampling import SamplingParams
from tests.conftest import as_bf16, write_recipe

VARIANTS = """\
  - {name: cpu-int8, target: onnxruntime, quantize: {mode: int8-dynamic, exclude: [lm_head], smoothing: 0.5}}
  - {name: cpu-int4, target: onnxruntime, quantize: {mode: int4, block_size: 16}}
  - {name: cpu-int8-mixed, target: onnxruntime, quantize: {mode: int8-dynamic, block_size: 64,
     exclude: ["model.layers.0.*", lm_head], exclude_block_size: 16}}
  - {name: cpu-int4-gptq, target: onnxruntime, quantize: {mode: int4, rounding: gptq}}
  - {name: cpu-int8-static, target: onnxruntime, quantize: {mode: int8-static, method: minmax, smoothing: 0.5}}
  - {name: cpu-int8-entropy, target: onnxruntime, quantize: {mode: int8-static, method: entropy, smoothing: 0.5}}
  - {name: cpu-fp16, target: onnxruntime, precision: fp16}
  - {name: trt-int8, target: tensorrt, quantize: {mode: int8-static}}
  - {name: trt-fp16, target: tensorrt, precision: fp16}
"""


@pytest.fixture(scope="module")
def quantized(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    recipe = write_recipe(root / "r.yaml", tiny_checkpoints["llama"], variants=VARIANTS,
                          extra="validate: {max_new_tokens: 8}\n")
    return compile_recipe(recipe, root / "artifact")


def _graph(artifact, variant):
    manifest = json.loads((artifact / "manifest.json").read_text())
    return manifest["variants"][variant], onnx.load(str(artifact / manifest["variants"][variant]["model"]))


def test_each_mode_makes_the_graph_it_promises(quantized):
    entry, graph = _graph(quantized, "cpu-int8")
    ops = [n.op_type for n in graph.graph.node]
    nbits = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
    assert {a.i for n in nbits for a in n.attribute if a.name == "bits"} == {8}
    assert ops.count("MatMul") >= 1  # lm_head kept in fp32 by exclude
    report = json.loads((quantized / entry["report"]).read_text())
    assert report["quantize"]["kept_fp32"] == ["lm_head"]
    assert "TopK" not in ops and report["quantize"]["exact_top_logits"] == "off: the LM head is kept in fp32"
    assert report["quantize"]["smoothing"]["folded_into"] == {  # each layer's two norms (not the head's), its
        "norm scales": 4, "up_proj columns": 2, "v_proj columns": 2}  # up_proj before down_proj, its v_proj

    for variant in ("cpu-int4", "cpu-int4-gptq"):
        entry, graph = _graph(quantized, variant)
        nbits = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
        assert {a.i for n in nbits for a in n.attribute if a.name == "bits"} == {4}
        assert not weight_matmuls(graph)  # every weight quantized, the LM head too
        ops = [n.op_type for n in graph.graph.node]
        assert ops.count("TopK") == 1 and ops.count("ScatterElements") == 1  # its top logits recomputed in fp32
        note = json.loads((quantized / entry["report"]).read_text())["quantize"]["exact_top_logits"]
        assert note.startswith("the top 32 logits recomputed in fp32 from a copy of the head's fp32 weight")

    for variant in ("cpu-int8-static", "trt-int8"):
        entry, graph = _graph(quantized, variant)
        q = [n for n in graph.graph.node if n.op_type == "QuantizeLinear"]
        assert q and any(n.op_type == "DequantizeLinear" for n in graph.graph.node)
        zero_points = {i.name: onnx.numpy_helper.to_array(i) for i in graph.graph.initializer}
        activation_zeros = {zero_points[n.input[2]].dtype.name: set(zero_points[n.input[2]].ravel().tolist())
                            for n in q}
        # Symmetric either way: int8 about 0 for TensorRT, uint8 about 128 for ONNX Runtime's x86 fusions
        assert activation_zeros == ({"uint8": {128}} if variant == "cpu-int8-static" else {"int8": {0}})

    entry, graph = _graph(quantized, "cpu-fp16")
    assert entry["interface"]["inputs"][3]["dtype"] == "float16"
    assert entry["interface"]["outputs"][0]["dtype"] == "float32"  # logits keep their type
    types = {i.data_type for i in graph.graph.initializer if len(i.dims) == 2}
    assert onnx.TensorProto.FLOAT16 in types


def test_excluded_modules_take_finer_blocks_with_exclude_block_size(quantized):
    entry, graph = _graph(quantized, "cpu-int8-mixed")
    report = json.loads((quantized / entry["report"]).read_text())["quantize"]
    finer = {"lm_head", *(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"),
             *(f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down"))}
    assert report["kept_fp32"] == [] and set(report["kept_finer_blocks"]) == finer
    assert not weight_matmuls(graph)  # nothing left in fp32
    blocks = [next(a.i for a in node.attribute if a.name == "block_size")
              for node in graph.graph.node if node.op_type == "MatMulNBits"]
    # In graph order, each layer's q/k/v packed, o, gate/up packed, down, then the LM head: layer 0 and the
    # head in blocks of 16, layer 1 in blocks of 64 (packing joins only weights in blocks of one size).
    assert blocks == [16] * 4 + [64] * 4 + [16]


def test_int8_static_runs_as_integer_matmuls_in_onnx_runtime(quantized, tmp_path):
    """ONNX Runtime's own optimizer turns every weight MatMul of the onnxruntime int8-static graph
    (smoothed first, outputs left fp32) into a MatMulIntegerToFloat; the same graph with int8 zero
    points (as TensorRT takes them) keeps the q/k/v and gate/up ones in fp32, over weights
    dequantized on every call."""
    import onnxruntime as ort

    def optimized_ops(path):
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node]

    entry, graph = _graph(quantized, "cpu-int8-static")
    matmuls = [n.op_type for n in graph.graph.node].count("MatMul")  # each a weight MatMul: attention is fused
    ops = optimized_ops(quantized / entry["model"])
    assert matmuls > 0 and "MatMul" not in ops and ops.count("MatMulIntegerToFloat") == matmuls
    report = json.loads((quantized / entry["report"]).read_text())["quantize"]
    assert report["smoothing"]["folded_into"]["norm scales"] == 4  # each layer's two norms

    inits = {i.name: i for i in graph.graph.initializer}
    for node in graph.graph.node:
        if node.op_type == "QuantizeLinear":
            zero = inits[node.input[2]]
            zero.CopyFrom(onnx.numpy_helper.from_array(
                (onnx.numpy_helper.to_array(zero).astype(np.int16) - 128).astype(np.int8), zero.name))
    onnx.save(graph, str(tmp_path / "int8.onnx"))
    ops = optimized_ops(tmp_path / "int8.onnx")
    assert ops.count("MatMul") >= matmuls // 2 and ops.count("MatMulIntegerToFloat") < matmuls


def test_entropy_calibration_clips_where_minmax_takes_the_whole_range(quantized):
    """The same graph calibrated on the same prompts: entropy's activation scales are minmax's or
    narrower (its threshold cuts a tail), and some are narrower (quantize_static's own entropy
    calibrator, 128 bins for 128 levels, gave minmax's scales exactly)."""
    def activation_scales(variant):
        _, graph = _graph(quantized, variant)
        inits = {i.name: onnx.numpy_helper.to_array(i) for i in graph.graph.initializer}
        return {n.input[0]: float(inits[n.input[1]]) for n in graph.graph.node
                if n.op_type == "QuantizeLinear" and inits[n.input[1]].size == 1}

    minmax, entropy = activation_scales("cpu-int8-static"), activation_scales("cpu-int8-entropy")
    assert minmax.keys() == entropy.keys() and minmax
    assert all(entropy[t] <= minmax[t] * (1 + 1e-6) for t in minmax)
    assert sum(entropy[t] < minmax[t] * 0.99 for t in minmax) >= len(minmax) // 2


def test_tensorrt_variants_keep_standard_graphs_and_are_skipped(quantized):
    for variant in ("trt-int8", "trt-fp16"):
        entry, graph = _graph(quantized, variant)
        assert entry["status"] == "skipped" and "TensorRT" in entry["reason"]
        assert all(not n.domain for n in graph.graph.node)


def test_every_variant_is_measured_and_generates(quantized):
    manifest = json.loads((quantized / "manifest.json").read_text())
    for name, entry in manifest["variants"].items():
        accuracy = entry["accuracy"]
        assert accuracy["perplexity"] > 1 and np.isfinite(accuracy["max_logit_error"]), name
        assert 0.5 < accuracy["top1_agreement"] <= 1.0, name
    fp16 = manifest["variants"]["cpu-fp16"]["accuracy"]
    assert fp16["top1_agreement"] > 0.97 and abs(fp16["perplexity_change"]) < 0.01
    for variant in ("cpu-int8", "cpu-int4", "cpu-int4-gptq", "cpu-int8-static", "cpu-fp16"):
        result = Generator.load(quantized, variant).generate(["The quick brown"], SamplingParams(max_new_tokens=5))
        assert result[0].generated_tokens >= 1 and result[0].error is None


def test_int8_ships_a_graph_for_kiln_cpu_kernels_measured_against_eager(quantized, monkeypatch):
    """Beside model.onnx, the same graph with each 8-bit MatMulNBits in blocks of 32 as Kiln's kernel
    (and a 4-bit variant's in blocks of 32 as its 4-bit one),
    over the same weights file, measured against eager under the variant's gates; the runtime runs it
    where the kernels run (runtime/cpu_kernels.py) and model.onnx elsewhere."""
    from runtime import cpu_kernels

    manifest = json.loads((quantized / "manifest.json").read_text())
    entry = manifest["variants"]["cpu-int8"]
    report = json.loads((quantized / entry["report"]).read_text())["cpu_kernels"]
    nodes = onnx.load(str(quantized / entry["model"]), load_external_data=False).graph.node
    eligible = [n for n in nodes if n.op_type == "MatMulNBits"]
    attentions = [n for n in nodes if n.op_type == "GroupQueryAttention"]
    fp32 = [n for n in nodes if n.op_type == "MatMul"]  # the LM head the quantizer kept in fp32
    assert report["nodes"] == len(eligible) + len(attentions) + len(fp32) and eligible and attentions and fp32
    library, why = cpu_kernels.library()
    if library is None:
        assert "kernel_model" not in entry and report["why_not"].endswith(f"({why})")
        pytest.skip(f"the kernels' graph is checked where Kiln's CPU kernels run: {why}")
    assert entry["kernel_model"] == "variants/cpu-int8/model_kernels.onnx" and entry["kernel_model"] in entry["files"]
    assert entry["kernel_accuracy"]["top1_agreement"] >= entry["gates"].get("top1_agreement", 0)
    assert (quantized / entry["kernel_comparison"]).is_file()
    kernel_graph = onnx.load(str(quantized / entry["kernel_model"]), load_external_data=False)
    ops = [(n.domain, n.op_type) for n in kernel_graph.graph.node]
    assert ops.count((cpu_kernels.DOMAIN, cpu_kernels.INT8_BLOCKS_OP)) == len(eligible)
    assert ops.count((cpu_kernels.DOMAIN, cpu_kernels.ATTENTION_OP)) == len(attentions)
    assert ("com.microsoft", "MatMulNBits") not in ops and ("com.microsoft", "GroupQueryAttention") not in ops
    assert ("", "Split") not in ops and ("", "Sigmoid") not in ops  # the gate/up's SwiGLU folded into the kernel
    packed = {n.input[1] for n in kernel_graph.graph.node if n.op_type == cpu_kernels.INT8_BLOCKS_OP}
    locations = {i.name: d.value for i in kernel_graph.graph.initializer for d in i.external_data if d.key == "location"}
    # The packed weights in a file of their own, every other weight read from model.onnx's file
    assert {locations[name] for name in packed} == {cpu_kernels.KERNEL_DATA_FILE}
    assert {where for name, where in locations.items() if name not in packed} == {"model.onnx.data"}
    assert f"variants/cpu-int8/{cpu_kernels.KERNEL_DATA_FILE}" in entry["files"]

    assert Generator.load(quantized, "cpu-int8").backend.kernels == library
    with monkeypatch.context() as patched:  # the caller's KILN_CPU_KERNELS comes back after it
        patched.setenv(cpu_kernels.DISABLE_VARIABLE, "0")
        cpu_kernels.library.cache_clear()
        assert Generator.load(quantized, "cpu-int8").backend.kernels is None
    cpu_kernels.library.cache_clear()

    mixed = manifest["variants"]["cpu-int8-mixed"]  # blocks of 64 and 16: the attention alone for the kernels
    mixed_ops = [(n.domain, n.op_type) for n in
                 onnx.load(str(quantized / mixed["kernel_model"]), load_external_data=False).graph.node]
    assert {op for op in mixed_ops if op[0] == cpu_kernels.DOMAIN} == {(cpu_kernels.DOMAIN, cpu_kernels.ATTENTION_OP)}
    assert ("com.microsoft", "MatMulNBits") in mixed_ops
    assert f"variants/cpu-int8-mixed/{cpu_kernels.KERNEL_DATA_FILE}" not in mixed["files"]

    # 4 bits in blocks of 32: bf16 activations by default (MatMulInt4BlocksBf16, on any CPU the library runs on)
    gptq = manifest["variants"]["cpu-int4-gptq"]
    kernel_ops = [n.op_type for n in onnx.load(str(quantized / gptq["kernel_model"]), load_external_data=False).graph.node]
    nodes = json.loads((quantized / gptq["report"]).read_text())["cpu_kernels"]["nodes"]
    assert kernel_ops.count(cpu_kernels.INT4_BF16_OP) > 0
    assert nodes == kernel_ops.count(cpu_kernels.INT4_BF16_OP) + kernel_ops.count(cpu_kernels.ATTENTION_OP)
    assert "MatMulNBits" not in kernel_ops
    assert gptq["kernel_activations"] == cpu_kernels.BF16_ACTIVATIONS
    # `kiln inspect` says which way this host multiplies them: the FMA path wherever AVX-512 BF16 is not used
    from runtime.artifact import Artifact
    from runtime.kiln_cli import _describe_variant

    opened = Artifact.open(quantized)
    path = "on AVX-512 BF16" if cpu_kernels.bf16() else "on FMAs (the same numbers)"
    assert f"4-bit activations bfloat16 {path}" in _describe_variant(opened, opened.variant("cpu-int4-gptq"))
    monkeypatch.setenv(cpu_kernels.BF16_PATH_VARIABLE, "fma")
    assert "bfloat16 on FMAs (the same numbers)" in _describe_variant(opened, opened.variant("cpu-int4-gptq"))


def test_missed_gate_fails_the_compile_with_its_numbers(tiny_checkpoints, tmp_path):
    variants = "  - {name: cpu-int4, target: onnxruntime, quantize: {mode: int4, block_size: 256}}\n"
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"], variants=variants,
                          extra="validate: {max_new_tokens: 8, gates: {top1_agreement: 0.9999, greedy_match: 1.0}}\n")
    with pytest.raises(GateFailure, match=r"cpu-int4: top1_agreement 0\.\d+ < 0\.9999"):
        compile_recipe(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    result = subprocess.run([sys.executable, "-m", "compiler.cli", str(recipe), "--out", str(tmp_path / "kept"),
                             "--keep-failed"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    entry = json.loads((tmp_path / "kept" / "manifest.json").read_text())["variants"]["cpu-int4"]
    assert entry["status"] == "failed" and entry["failed_gates"][0].startswith("top1_agreement")
    Generator.load(tmp_path / "kept", "cpu-int4")  # kept for inspection, loadable by name


def test_a_variant_for_the_kernels_alone_is_gated_on_their_graph(quantized, tiny_checkpoints, tmp_path, monkeypatch):
    """`cpu_kernels: required`: the gates hold the graph for Kiln's CPU kernels, model.onnx is measured and its
    misses recorded, and the runtime runs the variant only where the kernels run (one line elsewhere, and the
    default variant is then another). The same variant without the key fails, and the compile's line says its
    kernels' graph passed. The gate is set between the two graphs' numbers for the same int4 weights (bf16
    activations on the kernel, int8 blocks on MLAS), as the quantized fixture measured them."""
    from compiler.pipeline import gate_failure
    from runtime import cpu_kernels
    from runtime.artifact import Artifact
    from runtime.backends.registry import runnable_variant
    from runtime.errors import ArtifactError, IncompatibleArtifact
    from runtime.interop import export_folder

    if cpu_kernels.library()[0] is None:
        pytest.skip("Kiln's CPU kernels do not run on this machine")
    measured = json.loads((quantized / "manifest.json").read_text())["variants"]["cpu-int4-gptq"]
    model, kernels = measured["accuracy"], measured["kernel_accuracy"]
    if not kernels["kl_divergence"] < model["kl_divergence"]:
        pytest.skip(f"the kernels' graph is not closer to eager here (KL {kernels['kl_divergence']:.3g} against "
                    f"{model['kl_divergence']:.3g}): no gate between them")
    gate = f"gates: {{kl_divergence: {(kernels['kl_divergence'] + model['kl_divergence']) / 2!r}}}"
    int4 = "target: onnxruntime, quantize: {mode: int4, rounding: gptq}"
    variants = (f"  - {{name: int4-kernels, {int4}, cpu_kernels: required, {gate}}}\n"
                f"  - {{name: int4-anywhere, {int4}, {gate}}}\n"
                "  - {name: cpu-fp32, target: onnxruntime}\n")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"], variants=variants,
                          extra="validate: {max_new_tokens: 8}\n")
    folder = compile_recipe(recipe, tmp_path / "out", keep_failed=True)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["schema_version"] == 2  # a runtime that reads version 1 alone refuses it
    built = manifest["variants"]
    required, anywhere = built["int4-kernels"], built["int4-anywhere"]
    assert required["status"] == "built" and required["cpu_kernels"] == "required"
    assert required["model_failed_gates"][0].startswith("kl_divergence") and "kernel_model" in required
    assert anywhere["status"] == "failed" and anywhere["failed_gates"][0].startswith("kl_divergence")
    assert "cpu_kernels" not in anywhere and "kernel_accuracy" in anywhere
    assert "sidecars" not in required and not (folder / "variants" / "int4-kernels" / "genai_config.json").exists()
    from runtime.kiln_cli import _describe_variant

    opened = Artifact.open(folder)
    assert "opens in   Kiln alone" in _describe_variant(opened, opened.variant("int4-kernels"))
    line = gate_failure(built)
    assert "int4-anywhere: kl_divergence" in line and "`cpu_kernels: required` ships it" in line
    assert "int4-kernels" not in line and "\n" not in line

    generator = Generator.load(folder)  # the first built variant this host runs
    assert generator.backend.kernels == cpu_kernels.library()[0]
    assert generator.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].generated_tokens == 4
    with pytest.raises(ArtifactError, match="is for Kiln's CPU kernels alone: its model.onnx, which genai would run"):
        export_folder(Artifact.open(folder), "int4-kernels", "genai", tmp_path / "genai")
    assert not (tmp_path / "genai").exists()

    with monkeypatch.context() as patched:  # the caller's KILN_CPU_KERNELS comes back after it
        patched.setenv(cpu_kernels.DISABLE_VARIABLE, "0")
        cpu_kernels.library.cache_clear()
        with pytest.raises(IncompatibleArtifact) as refused:
            Generator.load(folder, "int4-kernels")
        assert "runs only on Kiln's CPU kernels" in str(refused.value) and "KILN_CPU_KERNELS=0" in str(refused.value)
        assert "kl_divergence" in str(refused.value) and "\n" not in str(refused.value)
        assert runnable_variant(Artifact.open(folder)).name == "cpu-fp32"  # the default: one this host runs
        assert Generator.load(folder).backend.kernels is None
        off = {**os.environ, cpu_kernels.DISABLE_VARIABLE: "0"}
        for command in (["runtime.cli", f"{folder}", "--variant", "int4-kernels", "--prompt", "Hi"],
                        ["runtime.kiln_cli", "plan", f"{folder}", "--variant", "int4-kernels", "--memory", "4GiB"]):
            done = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, env=off)
            assert done.returncode != 0 and "runs only on Kiln's CPU kernels" in done.stderr, done.stderr
            assert done.stderr.strip().count("\n") == 0
    cpu_kernels.library.cache_clear()


def test_metrics_on_known_arrays():
    logits = [np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))]
    assert perplexity(logits, [[0, 1]]) == pytest.approx(np.exp(-(np.log(0.5) + np.log(0.8)) / 2))
    assert greedy_match([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == {"greedy_match": 0.5,
                                                                           "first_divergence": [None, 1]}
    metrics = {"top1_agreement": 0.97, "greedy_match": 1.0, "perplexity_change_abs": 0.03, "max_logit_error": 1.0}
    assert failed_gates(metrics, {"top1_agreement": 0.98, "perplexity_change": 0.02, "greedy_match": 0.9}) == [
        "top1_agreement 0.97 < 0.98", "perplexity_change 0.03 > 0.02"]
    assert failed_gates({**metrics, "top1_agreement": float("nan")}, {"top1_agreement": 0.5})


def test_metrics_walk_long_rows_in_blocks_to_the_whole_rows_answer():
    """perplexity and agreement take a row's positions POSITION_BLOCK at a time: on rows longer than
    a block, with the block boundary inside them, they equal the formulas over whole rows."""
    from compiler.accuracy import POSITION_BLOCK, agreement

    rng = np.random.default_rng(3)
    lengths = (POSITION_BLOCK * 2 + 5, 7, POSITION_BLOCK)
    ref = [rng.normal(size=(n, 40)).astype(np.float32) for n in lengths]
    out = [r + rng.normal(scale=0.5, size=r.shape).astype(np.float32) for r in ref]
    targets = [rng.integers(0, 40, n) for n in lengths]
    whole = np.concatenate([lg - np.log(np.exp(lg.astype(np.float64)).sum(-1, keepdims=True)) for lg in ref])
    nll = -whole[np.arange(len(whole)), np.concatenate(targets)]
    assert perplexity(ref, targets) == pytest.approx(np.exp(nll.mean()), rel=1e-6)
    errors = np.abs(np.concatenate(out) - np.concatenate(ref))
    same = (np.concatenate(ref).argmax(-1) == np.concatenate(out).argmax(-1)).mean()
    assert agreement(ref, out) == pytest.approx({"top1_agreement": same, "max_logit_error": errors.max(),
                                                 "mean_logit_error": errors.mean()}, rel=1e-6)


def test_logits_on_disk_are_the_logits_in_memory(tiny_checkpoints, tiny_artifacts, tmp_path):
    """The compile writes both sides' logits to disk as they come (teacher_forced with `into`) and
    reads them back a row at a time: the rows are exactly the ones kept in memory, of their own
    shapes, for the graph stepped column by column and for eager torch's one pass per row alike, and
    every metric of the comparison is the same."""
    from transformers import AutoModelForCausalLM

    from compiler.accuracy import RowsOnDisk, measure, reference_run, teacher_forced
    from compiler.eager import EagerBackend
    from runtime.generator import Generator

    graph = Generator.load(tiny_artifacts["llama"], "cpu-fp32").backend
    eager = EagerBackend(AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"]).eval())
    rng = np.random.default_rng(0)
    rows = [[int(t) for t in rng.integers(1, 200, n)] for n in (90, 17, 70)]  # over POSITION_BLOCK
    for backend in (graph, eager):
        for last in (None, 9):
            kept = teacher_forced(backend, rows, 0, last)
            read = teacher_forced(backend, rows, 0, last, into=tmp_path / f"{id(backend)}-{last}.bin")
            assert isinstance(read, RowsOnDisk) and len(read) == len(rows)
            for a, b in zip(kept, read, strict=True):
                assert a.shape == b.shape == ((last or len(a)), backend.vocab_size) and np.array_equal(a, b)

    inputs = Inputs(text_rows=rows, prompts=[[5, 6, 7], [8, 9, 10, 11, 12]], new_tokens=4, pad_id=0)
    reference_kept, reference_read = reference_run(eager, inputs), reference_run(eager, inputs, tmp_path / "eager")
    timing = ("tokens_per_second_reference", "tokens_per_second", "tokens_per_second_ratio")
    results = [measure(graph, inputs, reference_kept), measure(graph, inputs, reference_read, tmp_path / "graph")]
    for result in results:
        for key in timing:
            result["summary"].pop(key)
    assert results[0] == results[1] and results[0]["summary"]["top1_agreement"] > 0.9


def test_fp16_overflow_is_found_at_compile_time(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from compiler.quantize import QuantizeError
    from tests.conftest import build_tiny_checkpoint

    folder = build_tiny_checkpoint("llama", tmp_path / "checkpoint")
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():  # silu(gate) * up now exceeds fp16's 65504; fp32 holds it (RMSNorm rescales)
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.mul_(1e4)
            layer.mlp.up_proj.weight.mul_(1e4)
    model.save_pretrained(folder)
    recipe = write_recipe(tmp_path / "r.yaml", folder, variants="  - {name: cpu-fp16, target: onnxruntime, "
                                                                  "precision: fp16}\n")
    with pytest.raises(QuantizeError, match=r"cpu-fp16: .* overflow \(inf or NaN\) on calibration prompt 1 in float16"):
        compile_recipe(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_each_variant_calibrates_on_its_own_file(tiny_checkpoints, tmp_path):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from compiler.pipeline import _validation_data
    from compiler.recipe import load_recipe

    for name, word in (("a.jsonl", "alpha"), ("b.jsonl", "omega")):
        (tmp_path / name).write_text(f'{{"prompt": "{word} {word}"}}\n' * 8)
    variants = ("  - {name: qa, target: onnxruntime, quantize: {mode: int8-static, calibration: a.jsonl}}\n"
                "  - {name: qb, target: onnxruntime, quantize: {mode: int8-static, calibration: b.jsonl}}\n"
                "  - {name: plain, target: onnxruntime, precision: fp16}\n")
    recipe, base = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"], variants=variants))
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints["llama"])
    encode = lambda text: tokenizer(text)["input_ids"]  # noqa: E731
    data = _validation_data(recipe, base, SimpleNamespace(encode=encode, pad_id=0))  # the eager side's tokenizer
    assert data.calibration["qa"] == [encode("alpha alpha")] * 8
    assert data.calibration["qb"] == [encode("omega omega")] * 8
    assert len(data.calibration["plain"]) == 32  # the shipped default set


def test_a_weight_on_an_int8_grid_keeps_it_exactly():
    """A GGUF Q8_0 tensor (every block a multiple of max|w| / 127) is encoded on its own grid: its
    codes and scales give back every weight exactly; a weight off any grid is left to ONNX Runtime."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from compiler.quantize import _encode_int8_grid, _int8_blocks, _on_int8_grid

    rng = np.random.default_rng(0)
    k, n, block = 64, 24, 32
    steps = rng.uniform(0.001, 0.01, (n, k // block, 1)).astype(np.float32)
    codes = rng.integers(-127, 128, (n, k // block, block))
    codes[:, :, 0] = 127  # each block's largest weight sets its scale, as Q8_0's quantizer does
    on_grid = (codes * steps).astype(np.float32).reshape(n, k).T.copy()
    off_grid = rng.standard_normal((k, n)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w_on"], ["a"], name="on"),
             helper.make_node("MatMul", ["x", "w_off"], ["b"], name="off")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info(o, onnx.TensorProto.FLOAT, [1, n]) for o in "ab"],
                              [numpy_helper.from_array(on_grid, "w_on"), numpy_helper.from_array(off_grid, "w_off")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])

    found = _on_int8_grid(model, block, excluded=[])
    assert list(found) == ["on"]
    codes8, scales = _int8_blocks(on_grid, block)
    assert np.allclose(((codes8.astype(np.float32) - 128) * scales[..., None]).reshape(n, k).T, on_grid,
                       rtol=1e-6, atol=0)
    _encode_int8_grid(model, found, block)
    assert [nd.op_type for nd in model.graph.node] == ["MatMulNBits", "MatMul"]
    assert "w_on" not in {i.name for i in model.graph.initializer}
    x = rng.standard_normal((1, k)).astype(np.float32)
    a, _ = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.abs(a - x @ on_grid).max() < 0.02 * np.abs(x @ on_grid).max()  # int8 activations, exact weights


@pytest.mark.parametrize("bits", [4, 8])
def test_a_weight_on_a_q4_1_grid_keeps_its_levels(bits, tmp_path):
    """A GGUF Q4_1 tensor (blocks of d * q + m, q = 0..15) is encoded with its own levels, at 4 bits or
    8: the output is within int8 activation rounding of x @ w, where rounding its zero point as ONNX
    Runtime's 4-bit quantizer does is several times further off (8x here). Two MatMuls reading one
    activation share its block means."""
    import onnxruntime as ort
    from onnx import helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from compiler.quantize import _encode_int4_grid, _on_int4_grid, _quantize_blocks

    rng = np.random.default_rng(0)
    k, n, block = 1152, 24, 32  # 36 blocks: their sums take two blocks of their own
    steps = rng.uniform(0.001, 0.01, (n, k // block, 1)).astype(np.float16).astype(np.float32)  # fp16, as GGUF's
    lows = (-rng.uniform(0, 15, (n, k // block, 1)) * steps).astype(np.float16).astype(np.float32)
    codes = rng.integers(0, 16, (n, k // block, block))
    codes[:, :, 0], codes[:, :, 1] = 0, 15  # each block's minimum and maximum set its levels, as Q4_1's do
    weights = [(codes * steps + lows).astype(np.float32).reshape(n, k).T.copy() for _ in range(2)]
    weights[1] = weights[1][:, ::-1].copy()
    nodes = [helper.make_node("MatMul", ["x", f"w{i}"], [f"y{i}"], name=f"mm{i}") for i in range(2)]
    nodes.append(helper.make_node("MatMul", ["x", "w_off"], ["y2"], name="off"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2, k])],
                              [helper.make_tensor_value_info(f"y{i}", onnx.TensorProto.FLOAT, [1, 2, n])
                               for i in range(3)],
                              [*(numpy_helper.from_array(w, f"w{i}") for i, w in enumerate(weights)),
                               numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w_off")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((1, 2, k)).astype(np.float32)

    def error(m, i):
        out = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
        return np.abs(out[i] - x @ weights[i]).max() / np.abs(x @ weights[i]).max()

    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the quantizer works in place
    rounded = MatMulNBitsQuantizer(copy, bits=bits, block_size=block, is_symmetric=False, accuracy_level=4)
    rounded.process()
    found = _on_int4_grid(model, block, excluded=[])
    assert list(found) == ["mm0", "mm1"]
    assert _on_int4_grid(model, 16, excluded=[]) == []  # halves of a block do not span its levels
    # So exclude_block_size: 16 would re-round them: in the int4 mode they keep their grid at 32 instead
    # (at 8 bits Q4_1 weights are rounded anyway, and finer blocks round them closer).
    later = onnx.ModelProto()
    later.CopyFrom(model)
    later, exact, _ = _quantize_blocks(later, None, SimpleNamespace(rounding="nearest"), None, bits, block,
                                       skipped=[], later=["mm0", "mm1", "off"], rescored_head=None, folder=tmp_path)
    assert exact == (["mm0", "mm1"] if bits == 4 else [])
    assert [nd.op_type for nd in later.graph.node if nd.op_type.startswith("MatMul")] == (
        ["MatMulNBits", "MatMulNBits", "MatMul"] if bits == 4 else ["MatMul"] * 3)  # the rest left for later
    _encode_int4_grid(model, found, block, bits)
    ops = [nd.op_type for nd in model.graph.node]
    assert ops.count("MatMulNBits") == 2 and ops.count("Concat") == ops.count("AveragePool") == 1  # block means, once for both
    onnx.checker.check_model(model)
    for i in range(2):
        assert error(model, i) < 0.01
        if bits == 4:
            assert error(rounded.model.model, i) > 5 * error(model, i)

    # Kiln's 4-bit kernel takes each node as one op on x alone, the correction as the blocks' offsets
    # times x's exact block sums: the block means' nodes go, and the error stays that of MatMulNBits.
    from compiler.graph import OnnxArtifact
    from compiler.optimize import kernel_graph
    from runtime import cpu_kernels

    library, why = cpu_kernels.library()
    if bits == 8:
        return  # the 8-bit kernel takes MatMulNBits' own numbers: no correction nodes to fold
    if library is None:
        pytest.skip(f"the 4-bit kernel's graph is checked where Kiln's CPU kernels run: {why}")
    (tmp_path / "graph").mkdir()
    onnx.save(model, str(tmp_path / "graph" / "model.onnx"))
    built, count = kernel_graph(OnnxArtifact(tmp_path / "graph", {}, None, 0, ["model.onnx"]), tmp_path / "kernels")
    kernels = onnx.load(str(built.model_path))
    assert count == 3 and [nd.op_type for nd in kernels.graph.node] == ["MatMulInt4Blocks"] * 2 + ["MatMulFp32"]
    assert [nd.input[0] for nd in kernels.graph.node] == ["x"] * 3
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    out = ort.InferenceSession(str(built.model_path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for i in range(2):
        assert np.abs(out[i] - x @ weights[i]).max() / np.abs(x @ weights[i]).max() < 1.2 * error(model, i)

    # With bf16 activations the kernel's only other rounding is its offsets': the correction's two parts
    # give each block's within 1/450 of a step (1.3e-4 of the output here), where one part gave 1/30.
    built, _ = kernel_graph(OnnxArtifact(tmp_path / "graph", {}, None, 0, ["model.onnx"]), tmp_path / "bf16",
                            activations="bf16")
    assert built.interface["activations"] == cpu_kernels.BF16_ACTIVATIONS
    out = ort.InferenceSession(str(built.model_path), options, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    x_bf16 = as_bf16(x).astype(np.float64)
    for i in range(2):
        assert np.abs(out[i] - x_bf16 @ weights[i]).max() / np.abs(x_bf16 @ weights[i]).max() < 5e-4


@pytest.mark.parametrize("variant", ["cpu-int8", "cpu-int8 on MLAS", "cpu-int4", "cpu-int4-gptq"])
def test_quantized_rows_give_the_same_numbers_in_any_batch(quantized, variant, monkeypatch):
    """int8 activation rounding turns a last-bit difference into another token, so a row's numbers
    must not depend on its neighbours: each row's logits batched equal its logits alone, bit for bit,
    and greedy tokens match. On a CPU with AVX2 but no AVX-512, the 4-bit kernel computes a lone row
    of blocks of 32 (cpu-int4-gptq) differently, and this holds only through the backend's spare row
    (runtime/backends/onnxruntime.py, lone rows). cpu-int8 runs on Kiln's CPU kernels where this machine has them,
    and on MLAS's MatMulNBits with them turned off."""
    from runtime import cpu_kernels

    with monkeypatch.context() as patched:  # the caller's KILN_CPU_KERNELS comes back after it
        if variant.endswith(" on MLAS"):
            variant = variant.removesuffix(" on MLAS")
            patched.setenv(cpu_kernels.DISABLE_VARIABLE, "0")
        cpu_kernels.library.cache_clear()
        generator = Generator.load(quantized, variant, threads=2)
    cpu_kernels.library.cache_clear()
    assert generator.backend.front_aligned
    assert generator.backend.rows_alike_in_prompts == (generator.backend.kernels is not None)  # prompts in one step
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(1, 300, int(rng.integers(3, 40)))] for _ in range(8)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=0)
    alone = [generator.generate([p], params)[0] for p in prompts]
    together = generator.generate(prompts, params)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert [[t.logprob for t in r.logprobs] for r in together] == [[t.logprob for t in r.logprobs] for r in alone]


def _lm_head_graph(tied: bool, vocab: int = 300, hidden: int = 64, on_int8_grid: bool = False):
    """input_ids -> embedding Gather; hidden -> LM head MatMul -> logits, the head tied to the table
    (stored transposed, as untie_transposed_weights leaves it) or a weight of its own; with
    `on_int8_grid`, the table on a GGUF Q8_0 grid (blocks of 32 along hidden)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    table = rng.normal(0, 1, (vocab, hidden)).astype(np.float32)
    if on_int8_grid:
        blocks = table.reshape(vocab, -1, 32)
        steps = np.abs(blocks).max(-1, keepdims=True) / 127
        table = (np.rint(blocks / steps) * steps).reshape(vocab, hidden).astype(np.float32)
    head = table.T.copy() if tied else rng.normal(0, 1, (hidden, vocab)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "input_ids"], ["embedded"], name="embed", axis=0),
         helper.make_node("MatMul", ["hidden", "head"], ["logits"], name="lm_head")],
        "head", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
                 helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["b", "s", hidden])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab]),
         helper.make_tensor_value_info("embedded", TensorProto.FLOAT, ["b", "s", hidden])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(head, "head")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model, head


@pytest.mark.parametrize("tied", [True, False])
def test_quantized_lm_head_gets_its_top_logits_exactly(tied):
    """The int8 head's top logits are replaced by the fp32 head's, from the tied table (no new
    weight) or a transposed copy; below them the quantized logits stay; rows do not mix."""
    import onnxruntime as ort
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from compiler.quantize import _exact_rows, _rescore_top_logits
    from compiler.weights import lm_head

    model, head = _lm_head_graph(tied)
    assert lm_head(model) == "lm_head"
    rows = _exact_rows(model, "lm_head")
    assert (rows.name == "table") == tied and (rows.tensor is None) == tied
    quantizer = MatMulNBitsQuantizer(model, bits=8, block_size=32, is_symmetric=False, accuracy_level=4)
    quantizer.process()
    quantized = quantizer.model.model
    plain = onnx.ModelProto()
    plain.CopyFrom(quantized)
    _rescore_top_logits(quantized, rows, 8)
    onnx.checker.check_model(quantized)
    assert [i.name for i in quantized.graph.initializer].count("table") == 1

    rng = np.random.default_rng(1)
    hidden = rng.normal(0, 1, (3, 5, 64)).astype(np.float32)
    feed = {"input_ids": np.zeros((3, 5), np.int64), "hidden": hidden}

    def logits(proto):
        return ort.InferenceSession(proto.SerializeToString()).run(["logits"], feed)[0]

    exact, approx, rescored = hidden @ head, logits(plain), logits(quantized)
    top = np.argsort(-approx, axis=-1)[..., :8]
    assert np.abs(np.take_along_axis(approx, top, -1) - np.take_along_axis(exact, top, -1)).max() > 1e-3
    np.testing.assert_allclose(np.take_along_axis(rescored, top, -1), np.take_along_axis(exact, top, -1),
                               rtol=1e-5, atol=1e-5)
    rest = np.ones(approx.shape, bool)
    np.put_along_axis(rest, top, False, -1)
    assert np.array_equal(rescored[rest], approx[rest])
    assert (rescored.argmax(-1) == exact.argmax(-1)).all()
    one = ort.InferenceSession(quantized.SerializeToString()).run(
        ["logits"], {"input_ids": feed["input_ids"][1:2], "hidden": hidden[1:2]})[0]
    assert np.array_equal(one[0], rescored[1])


@pytest.mark.parametrize("mode, top, bits", [("int4", 32, 4), ("int4", 0, 8), ("int8-dynamic", 32, 8)])
def test_an_lm_head_leaves_its_int8_grid_only_for_int4_with_its_top_logits_rescored(tmp_path, mode, top, bits):
    """A head on a Q8_0 grid keeps it at 8 bits, but in the int4 mode with its top logits rescored
    in fp32 it goes to 4 bits like the rest: the top logits (so greedy tokens) are the fp32 head's
    all the same."""
    from types import SimpleNamespace

    import onnxruntime as ort

    from compiler.quantize import QUANTIZERS, _on_int8_grid
    from compiler.recipe import Variant

    model, head = _lm_head_graph(tied=True, on_int8_grid=True)
    assert _on_int8_grid(model, 32, excluded=[]) == ["lm_head"]
    variant = Variant(name="v", target="onnxruntime", quantize={"mode": mode, "exact_top_logits": top})
    _, kept_grid, notes = QUANTIZERS[("fp32", mode)](model, SimpleNamespace(interface={}), variant, [], [],
                                                      tmp_path)
    assert kept_grid == ([] if bits == 4 else ["lm_head"])
    assert notes["exact_top_logits"].endswith("re-rounded from its int8 source grid") == (bits == 4)
    saved = onnx.load(str(tmp_path / "model.onnx"))
    (nbits,) = [n for n in saved.graph.node if n.op_type == "MatMulNBits"]
    assert next(a.i for a in nbits.attribute if a.name == "bits") == bits

    hidden = np.random.default_rng(1).normal(0, 1, (2, 6, 64)).astype(np.float32)
    logits = ort.InferenceSession(str(tmp_path / "model.onnx")).run(
        ["logits"], {"input_ids": np.zeros((2, 6), np.int64), "hidden": hidden})[0]
    exact = hidden @ head
    if top:
        assert (logits.argmax(-1) == exact.argmax(-1)).all()
        best = np.argsort(-exact, -1)[..., :8]
        np.testing.assert_allclose(np.take_along_axis(logits, best, -1), np.take_along_axis(exact, best, -1),
                                   rtol=1e-5, atol=1e-5)
    off = np.abs(logits - exact).max()  # of logits up to 29: the 8-bit head's int8 activations 0.16, 4 bits' 3.0
    assert off > 1.0 if bits == 4 else off < 0.5
