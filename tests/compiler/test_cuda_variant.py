"""`target: onnxruntime-cuda`: built and checked on a machine without a GPU. Its graph is half precision
end to end, predicted to run every compute node on CUDA, held to the gates against eager under the CPU
provider; the runtime refuses it on a host without CUDA in one line and runs it on the CPU when asked."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest

from compiler.cuda_placement import predict
from compiler.pipeline import compile_recipe
from compiler.recipe import RecipeError, load_recipe
from runtime.artifact import Artifact
from runtime.backends.onnxruntime_cuda import cuda_missing
from runtime.backends.registry import host_fit, kind_of, runnable_variant
from runtime.errors import IncompatibleArtifact
from runtime.generator import Generator
from runtime.sampling import SamplingParams
from tests.conftest import write_recipe

VARIANTS = """\
  - {name: cuda-fp16, target: onnxruntime-cuda, precision: fp16}
  - {name: cpu-fp16, target: onnxruntime, precision: fp16}
  - {name: cuda-int4, target: onnxruntime-cuda, precision: fp16, quantize: {mode: int4, block_size: 16}}
  - {name: cuda-bf16, target: onnxruntime-cuda, precision: bf16}
  - {name: cuda-bf16-int4, target: onnxruntime-cuda, precision: bf16, quantize: {mode: int4, block_size: 16}}
"""
NO_CUDA = cuda_missing() is not None


@pytest.fixture(scope="module")
def cuda_artifact(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda")
    recipe = write_recipe(root / "r.yaml", tiny_checkpoints["llama"], variants=VARIANTS,
                          extra="validate: {max_new_tokens: 8}\n")
    return compile_recipe(recipe, root / "artifact")


def test_the_cuda_graph_is_half_precision_and_predicted_all_on_cuda(cuda_artifact):
    manifest = json.loads((cuda_artifact / "manifest.json").read_text())
    entry = manifest["variants"]["cuda-fp16"]
    assert entry["status"] == "built" and entry["providers"] == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert "kernel_model" not in entry  # Kiln's CPU kernels are the CPU's
    assert entry["fusions"]["group_query_attention"] == 2 and entry["fusions"]["pack_matmuls"] > 0
    graph = onnx.load(str(cuda_artifact / entry["model"]), load_external_data=False)
    half = {value.name for value in graph.graph.input if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16}
    assert half == {"past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key",
                    "past_key_values.1.value"}
    logits = next(o for o in graph.graph.output if o.name == "logits")
    assert logits.type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # logits come back in fp32
    report = json.loads((cuda_artifact / "variants" / "cuda-fp16" / "report.json").read_text())
    placement = report["cuda_placement"]
    assert placement["on_cpu"] == [] and placement["compute_nodes"] > 20 and placement["onnxruntime_gpu"] == "1.31.1"
    # The CPU variant's fp16 keeps attention in fp32, which has no CUDA kernel: what the H200 probe saw.
    cpu_graph = onnx.load(str(cuda_artifact / manifest["variants"]["cpu-fp16"]["model"]), load_external_data=False)
    assert {n["op"] for n in predict(cpu_graph).on_cpu} == {"com.microsoft::GroupQueryAttention"}


def test_the_cuda_graph_meets_the_gates_against_eager_on_the_cpu(cuda_artifact, tiny_checkpoints):
    """The gates were measured under the CPU provider; the runtime's greedy tokens on the CPU equal
    transformers' eager fp32 greedy on the checkpoint itself."""
    import torch
    from transformers import AutoModelForCausalLM

    report = json.loads((cuda_artifact / "reports" / "cuda-fp16.json").read_text())
    assert report["passed"] and "the graph the CUDA provider runs" in report["b"]["description"]
    prompt = [5, 17, 42, 7]
    generator = Generator.load(cuda_artifact, "cuda-fp16", providers=["CPUExecutionProvider"])
    tokens = generator.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"]).eval()
    with torch.no_grad():
        eager = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert tokens == eager[0, len(prompt):].tolist()


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a host without CUDA")
def test_a_host_without_cuda_skips_the_variant_and_refuses_it_by_name(cuda_artifact):
    artifact = Artifact.open(cuda_artifact)
    entry = artifact.variant("cuda-fp16")
    assert kind_of(entry).name == "onnxruntime-cuda"
    assert runnable_variant(artifact).name == "cpu-fp16"  # the default: a variant this host runs
    with pytest.raises(IncompatibleArtifact, match="variant 'cuda-fp16' is built for ONNX Runtime's CUDA provider, "
                                                   "and this onnxruntime has no CUDA provider"):
        runnable_variant(artifact, "cuda-fp16")
    fit = host_fit("cuda-fp16", entry, artifact.manifest)
    assert not fit.fits and fit.target == "onnxruntime-cuda" and "onnxruntime-gpu >= 1.31.1" in fit.needs
    result = subprocess.run([sys.executable, "-m", "runtime.cli", str(cuda_artifact), "--variant", "cuda-fp16",
                             "--prompt", "hi"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert "built for ONNX Runtime's CUDA provider" in result.stderr
    verify = subprocess.run([sys.executable, "-m", "runtime.kiln_cli", "verify", str(cuda_artifact)],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stderr
    assert "cuda-fp16" in verify.stdout and "onnxruntime-gpu >= 1.31.1" in verify.stdout


@pytest.mark.parametrize(("variant", "message"), [
    ("{name: c, target: onnxruntime-cuda, precision: fp16, fuse: false}",
     "fuse: false cannot be built for onnxruntime-cuda"),
    ("{name: c, target: onnxruntime-cuda}", "fp32 cannot be built for onnxruntime-cuda; allowed: bf16, bf16 + int4, fp16, fp16 + int4"),
    ("{name: c, target: onnxruntime-cuda, precision: fp16, quantize: {mode: int8-dynamic}}",
     "fp16 + int8-dynamic cannot be built for onnxruntime-cuda; allowed: bf16, bf16 + int4, fp16, fp16 + int4"),
    ("{name: c, target: onnxruntime-cuda, precision: fp16, cpu_kernels: required}",
     "cpu_kernels: required is for onnxruntime variants"),
])
def test_what_a_cuda_variant_cannot_be_is_refused_in_the_recipe(variant, message, tiny_checkpoints, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"], variants=f"  - {variant}\n")
    with pytest.raises(RecipeError) as error:
        load_recipe(recipe)
    assert message in str(error.value)


def _run(*args):
    return subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True)


def test_device_picks_and_refuses_variants_in_one_line(cuda_artifact, tmp_path):
    """--device cpu runs a CUDA variant's graph on the CPU when it is named, and otherwise picks a CPU
    variant; --device cuda never runs a CPU variant; a device that is none of them is a usage error."""
    on_cpu = _run("runtime.cli", cuda_artifact, "--variant", "cuda-fp16", "--device", "cpu", "--prompt", "hi",
                  "--max-new-tokens", "4")
    assert on_cpu.returncode == 0, on_cpu.stderr
    assert Generator.load(cuda_artifact, device="cpu").engine is not None
    assert runnable_variant(Artifact.open(cuda_artifact), providers=["CPUExecutionProvider"]).name == "cpu-fp16"
    for command in (["runtime.cli", cuda_artifact, "--prompt", "hi"],
                    ["runtime.kiln_cli", "serve", cuda_artifact, "--port", "0"],
                    ["runtime.kiln_cli", "batch", cuda_artifact, tmp_path / "in.jsonl", tmp_path / "out.jsonl"]):
        (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
        refused = _run(*command, "--variant", "cpu-fp16", "--device", "cuda:1")
        assert refused.returncode == 2, (command, refused.stderr)
        assert refused.stderr.strip().count("\n") == 0
        assert "variant 'cpu-fp16' is built for the CPU (target onnxruntime), not for CUDA" in refused.stderr
        assert not (tmp_path / "out.jsonl").exists()
    bad = _run("runtime.cli", cuda_artifact, "--prompt", "hi", "--device", "gpu")
    assert bad.returncode == 2 and "'--device': not cpu, cuda, cuda:N or auto" in bad.stderr


def test_compare_model_runs_both_variants_on_the_cpu(cuda_artifact, tmp_path):
    """compare-model --device cpu: the CUDA variant's graph against the CPU variant's, A/B on this host."""
    from click.testing import CliRunner

    from compiler.cli import compare_main

    result = CliRunner().invoke(compare_main, [f"{cuda_artifact}:cpu-fp16", f"{cuda_artifact}:cuda-fp16", "--device",
                                               "cpu", "--max-new-tokens", "8", "--speed-repeats", "0",
                                               "--report", str(tmp_path / "report")])
    assert result.exit_code in (0, 1), result.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["summary"]["top1_agreement"] > 0.9 and "cuda-fp16" in report["b"]["label"]


def test_measured_placement_reads_onnx_runtimes_profile(cuda_artifact, tmp_path):
    """What a GPU host's compile records, read here from the CPU provider's profile of the same graph: every
    node it ran is on the CPU, the shape arithmetic left out, and no copy to the host (one device)."""
    from compiler.cuda_placement import measure

    entry = json.loads((cuda_artifact / "manifest.json").read_text())["variants"]["cuda-fp16"]
    placement = measure(cuda_artifact / entry["model"], entry["interface"], ["CPUExecutionProvider"], tmp_path)
    predicted = predict(onnx.load(str(cuda_artifact / entry["model"]), load_external_data=False))
    assert placement.measured["providers"] == ["CPUExecutionProvider"] and placement.measured["copies_to_host"] == 0
    ran = {n["node"] for n in placement.on_cpu}
    attention = {n.name for n in onnx.load(str(cuda_artifact / entry["model"]), load_external_data=False).graph.node
                 if n.op_type == "GroupQueryAttention"}
    assert attention <= ran and not ran & predicted.shape_nodes
    assert not placement.all_on_cuda and placement.summary().startswith("measured on CPUExecutionProvider: ")
    assert placement.to_json()["predicted"] is False


def test_the_row_graphs_move_rows_as_numpy_does_and_run_on_cuda(tmp_path):
    import onnxruntime as ort

    from compiler.kv_rows import write_kv_row_graphs

    names = write_kv_row_graphs(tmp_path, "float16")
    gather, scatter = (ort.InferenceSession(str(tmp_path / name)) for name in names)
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((3, 2, 10, 4)).astype(np.float16)
    kept = gather.run(None, {"cache": cache, "rows": np.array([2, -1, 0, 0]), "keep": np.array([6]),
                             "capacity": np.array([12])})[0]
    expected = np.zeros((4, 2, 12, 4), np.float16)
    expected[0, :, :6], expected[2, :, :6], expected[3, :, :6] = cache[2, :, :6], cache[0, :, :6], cache[0, :, :6]
    assert np.array_equal(kept, expected)
    source = rng.standard_normal((2, 2, 7, 4)).astype(np.float16)
    written = scatter.run(None, {"cache": cache, "rows": np.array([1, 2]), "source": source,
                                 "source_rows": np.array([1, 0]), "count": np.array([5])})[0]
    expected = cache.copy()
    expected[1, :, :5], expected[2, :, :5] = source[1, :, :5], source[0, :, :5]
    assert np.array_equal(written, expected)
    for name in names:
        assert predict(onnx.load(str(tmp_path / name))).all_on_cuda
    (tmp_path / "bf16").mkdir()
    for name in write_kv_row_graphs(tmp_path / "bf16", "bfloat16"):
        placement = predict(onnx.load(str(tmp_path / "bf16" / name)))
        assert placement.all_on_cuda, placement.on_cpu  # CUDA's Pad takes no bf16: padded between Casts


def test_the_device_resident_cache_decodes_as_the_cpu_backend(cuda_artifact):
    """OnnxRuntimeCudaBackend with its OrtValues in host memory (device cpu): the same tokens as the CPU
    backend through joins, a prompt fed in pieces, compaction and beams, all its row moves on the graphs."""
    from runtime.backends.onnxruntime import OnnxRuntimeBackend
    from runtime.backends.onnxruntime_cuda import OnnxRuntimeCudaBackend
    from runtime.model import Model
    from runtime.tokenizer import Tokenizer

    artifact = Artifact.open(cuda_artifact)
    entry = artifact.variant("cuda-fp16")
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(3, 300, size=n)] for n in (3, 9, 5, 17, 2, 11, 7, 4, 13, 6)]

    def tokens(backend, params):
        model = Model(artifact, entry, backend, Tokenizer(artifact.tokenizer_dir))
        generator = Generator.of(model, 4, 8)  # 4 rows for 10 prompts: joins; 8-token prefill steps: pieces
        return [r.token_ids for r in generator.generate(prompts, params)]

    graph = cuda_artifact / entry.model
    rows = [cuda_artifact / path for path in entry.kv_row_graphs]
    for params in (SamplingParams(max_new_tokens=12, ignore_eos=True),
                   SamplingParams(max_new_tokens=8, num_beams=3, ignore_eos=True)):
        on_device = OnnxRuntimeCudaBackend(graph, entry.interface, *rows, ["CPUExecutionProvider"], "cpu")
        assert not on_device.limits.rows_in_place and on_device.view_rows(on_device.new_cache(2, 8), 0, 1) is None
        assert tokens(on_device, params) == tokens(OnnxRuntimeBackend(graph, entry.interface), params)


def test_int4_weights_over_half_precision_activations(cuda_artifact):
    """cuda-int4: MatMulNBits with fp16 activations and scales (CUDA's kernel takes them), every compute node
    predicted on CUDA, run here under the CPU provider against eager like the fp16 variant."""
    manifest = json.loads((cuda_artifact / "manifest.json").read_text())
    entry = manifest["variants"]["cuda-int4"]
    assert entry["status"] == "built" and entry["quantize"]["mode"] == "int4"
    graph = onnx.load(str(cuda_artifact / entry["model"]), load_external_data=False)
    placement = predict(graph)
    assert placement.all_on_cuda, placement.on_cpu
    blocks = [n for n in graph.graph.node if n.op_type == "MatMulNBits"]
    assert blocks
    scales = {i.name: i.data_type for i in graph.graph.initializer}
    assert all(scales[n.input[2]] == onnx.TensorProto.FLOAT16 for n in blocks)
    report = json.loads((cuda_artifact / "reports" / "cuda-int4.json").read_text())
    assert report["summary"]["perplexity_change"] < 0.05  # measured against eager on the CPU provider


@pytest.mark.parametrize("name", ["cuda-bf16", "cuda-bf16-int4"])
def test_bf16_variants_are_bfloat16_on_cuda_and_meet_the_gates_through_their_fp32_twin(cuda_artifact, name):
    """precision: bf16: every half tensor of the fp16 graph in bfloat16 (the KV cache, the weights or the
    int4 scales), every compute node predicted on CUDA, and the gates measured on its fp32 twin, which
    the CPU provider runs (it has no bfloat16 MatMul or attention)."""
    import ml_dtypes

    from compiler.graph import initializer_array

    manifest = json.loads((cuda_artifact / "manifest.json").read_text())
    entry = manifest["variants"][name]
    assert entry["status"] == "built" and entry["interface"]["inputs"][3]["dtype"] == "bfloat16"
    graph = onnx.load(str(cuda_artifact / entry["model"]), load_external_data=False)
    kv = {v.name for v in graph.graph.input if v.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16}
    assert kv == {f"past_key_values.{layer}.{kind}" for layer in (0, 1) for kind in ("key", "value")}
    types = {i.data_type for i in graph.graph.initializer}
    assert onnx.TensorProto.FLOAT16 not in types and onnx.TensorProto.BFLOAT16 in types
    assert predict(graph).all_on_cuda, predict(graph).on_cpu
    if name == "cuda-bf16":  # weights rounded from fp32 to bf16 once, not through fp16
        fp16 = manifest["variants"]["cuda-fp16"]
        half = onnx.load(str(cuda_artifact / fp16["model"]), load_external_data=False)
        embed = next(i for i in graph.graph.initializer if "embed" in i.name)
        embed16 = next(i for i in half.graph.initializer if i.name == embed.name)
        bf16 = initializer_array(embed, (cuda_artifact / entry["model"]).parent)
        via_fp16 = initializer_array(embed16, (cuda_artifact / fp16["model"]).parent)
        assert np.abs(bf16.astype(np.float32) - via_fp16.astype(np.float32)).max() < 2 ** -7
    report = json.loads((cuda_artifact / "reports" / f"{name}.json").read_text())
    assert report["passed"] and "fp32 twin" in report["b"]["description"]
    assert report["summary"]["perplexity_change"] < 0.05
    del ml_dtypes


def test_the_fp32_twin_rounds_what_each_node_writes_to_bf16(tmp_path):
    """A bf16 MatMul then Add, and its twin on the CPU: the twin's output is numpy's fp32 product rounded to
    bf16 (ml_dtypes), then the sum rounded again, as a GPU writes each node's output in bf16."""
    import ml_dtypes
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from compiler.bf16 import fp32_twin

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 8)).astype(ml_dtypes.bfloat16)
    bias = rng.standard_normal(8).astype(ml_dtypes.bfloat16)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["z"]),
             helper.make_node("Cast", ["z"], ["out"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 8])],
                              [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(bias, "b")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)
    with pytest.raises(Exception, match="NOT_IMPLEMENTED|bfloat16|BFloat16"):
        ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    twin = fp32_twin(proto, tmp_path)
    x = rng.standard_normal((2, 8)).astype(ml_dtypes.bfloat16)
    out = ort.InferenceSession(twin.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.astype(np.float32)})[0]
    product = (x.astype(np.float32) @ weight.astype(np.float32)).astype(ml_dtypes.bfloat16)
    expected = (product.astype(np.float32) + bias.astype(np.float32)).astype(ml_dtypes.bfloat16).astype(np.float32)
    assert np.array_equal(out, expected)
    unrounded = x.astype(np.float32) @ weight.astype(np.float32) + bias.astype(np.float32)
    assert not np.array_equal(out, unrounded)  # the rounding is there to see


def test_a_bf16_op_without_a_cuda_kernel_fails_the_placement():
    """Einsum has CUDA kernels for fp32 and fp16, not bf16 (an MoE's dense experts): named as on the CPU."""
    from onnx import TensorProto, helper

    node = helper.make_node("Einsum", ["a", "b"], ["c"], equation="ij,jk->ik", name="experts")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.BFLOAT16, [2, 2])
                                            for n in "ab"], [helper.make_tensor_value_info("c", TensorProto.BFLOAT16,
                                                                                          [2, 2])])
    placement = predict(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    assert [n["node"] for n in placement.on_cpu] == ["experts"]
    assert "T=bfloat16 (CUDA takes double, float, float16)" in placement.on_cpu[0]["why"]


def test_a_bf16_variant_is_refused_on_the_cpu_in_one_line(cuda_artifact):
    with pytest.raises(IncompatibleArtifact, match="variant 'cuda-bf16' is bfloat16, which ONNX Runtime's CPU "
                                                   "provider has no kernels for"):
        Generator.load(cuda_artifact, "cuda-bf16", providers=["CPUExecutionProvider"])
    on_cpu = _run("runtime.cli", cuda_artifact, "--variant", "cuda-bf16", "--device", "cpu", "--prompt", "hi")
    assert on_cpu.returncode == 2 and on_cpu.stderr.strip().count("\n") == 0
    assert "is bfloat16" in on_cpu.stderr and "--device cuda" in on_cpu.stderr
