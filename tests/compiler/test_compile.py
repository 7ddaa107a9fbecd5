"""The whole compile on tiny models of every family: export, ORT-vs-eager, artifact and manifest."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import compiler.pipeline
import compiler.validate_export
from compiler.errors import ExportMismatch
from compiler.export import kv_names
from compiler.families import FAMILIES
from compiler.pipeline import compile_recipe
from runtime.artifact import Artifact, sha256_file
from runtime.backends.onnxruntime import OnnxRuntimeBackend
from runtime.errors import ArtifactError
from tests.conftest import small_tmpfs, write_recipe


def test_artifact_layout_and_manifest(tiny_artifacts, family):
    folder = tiny_artifacts[family]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["schema_version"] == 1 and manifest["name"] == f"tiny-{family}"
    for name in ("tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json", "tokenizer/generation_config.json",
                 "variants/cpu-fp32/model.onnx", "reports/export-validation.json", "reports/cpu-fp32.json",
                 "reports/cpu-fp32.md", "reports/cpu-fp32.html", "reports/cpu-fp32-unfused.html"):
        assert name in manifest["files"], name
    for relative, entry in manifest["files"].items():
        assert sha256_file(folder / relative) == entry["sha256"]
        assert (folder / relative).stat().st_size == entry["size"]
    assert {"torch", "transformers", "onnx", "onnxruntime", "kiln"} <= set(manifest["tools"])
    assert manifest["source"]["kind"] == "folder" and len(manifest["source"]["sha256"]) == 64
    assert manifest["model"]["eos_token_ids"] == [0]
    assert manifest["model"]["family"] == (FAMILIES[family].name if family in FAMILIES else family)  # generic: its type
    assert manifest["variants"]["cpu-fp32"]["status"] == "built"
    # The validate stage is compare-model's A/B against eager torch: an exact fp32 build matches it.
    comparison = json.loads((folder / "reports" / "cpu-fp32.json").read_text())
    assert comparison["a"]["label"].startswith("eager:") and comparison["summary"]["greedy_match"] == 1.0
    assert comparison["summary"] == manifest["variants"]["cpu-fp32"]["accuracy"]
    assert set(manifest["compile"]["stage_seconds"]) == {"load", "export", "validate export", "reference",
                                                         "variant cpu-fp32", "variant cpu-fp32-unfused"}
    assert not list(folder.parent.glob(f".{folder.name}.*")), "staging folder left behind"


def test_validation_recorded_and_within_tolerance(tiny_artifacts, family):
    manifest = json.loads((tiny_artifacts[family] / "manifest.json").read_text())
    validation = manifest["export"]["validation"]
    assert validation["max_rel_logit_error"] <= validation["tolerance_relative"] == 1e-4
    assert validation["max_rel_kv_error"] <= 1e-4
    assert validation["top1_agreement"] == 1.0
    cases = json.loads((tiny_artifacts[family] / "reports" / "export-validation.json").read_text())["cases"]
    assert len(cases) == len(compiler.validate_export.CASES) == 5


def test_graph_matches_the_interface(tiny_artifacts, family):
    folder = tiny_artifacts[family]
    manifest = json.loads((folder / "manifest.json").read_text())
    interface = manifest["variants"]["cpu-fp32"]["interface"]
    model = onnx.load(str(folder / "variants" / "cpu-fp32" / "model.onnx"), load_external_data=False)
    layers = interface["layers"]
    assert [i.name for i in model.graph.input] == [
        "input_ids", "attention_mask", "position_ids", *kv_names(layers, "past_key_values")]
    assert [o.name for o in model.graph.output] == ["logits", *kv_names(layers, "present")]
    dims = [d.dim_param or d.dim_value for d in model.graph.input[3].type.tensor_type.shape.dim]
    assert dims[0] and isinstance(dims[0], str) and isinstance(dims[2], str)  # batch and past are dynamic
    assert dims[1] == interface["kv_heads"] and dims[3] == interface["head_dim"]
    # The lowest IR version opset 18 allows, so lagging onnxruntime-gpu builds can load it.
    assert model.ir_version == 8


def _greedy_with_ort(session, layers, kv_heads, head_dim, prompt, steps):
    """A plain prefill + decode loop over the graph, written independently of the runtime."""
    ids = np.array([prompt], dtype=np.int64)
    mask = np.ones_like(ids)
    past = {n: np.zeros((1, kv_heads, 0, head_dim), np.float32) for n in kv_names(layers, "past_key_values")}
    positions = np.arange(ids.shape[1], dtype=np.int64)[None]
    out = []
    for _ in range(steps):
        logits, *present = session.run(None, {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past})
        token = int(logits[0, -1].argmax())
        out.append(token)
        past = dict(zip(past, present, strict=True))
        ids = np.array([[token]], dtype=np.int64)
        positions = np.array([[mask.shape[1]]], dtype=np.int64)
        mask = np.ones((1, mask.shape[1] + 1), dtype=np.int64)
    return out


def test_decode_loop_matches_transformers_generate(tiny_artifacts, tiny_checkpoints, family):
    import torch
    from transformers import AutoModelForCausalLM

    folder = tiny_artifacts[family]
    interface = json.loads((folder / "manifest.json").read_text())["interface"]
    session = ort.InferenceSession(str(folder / "variants/cpu-fp32/model.onnx"), providers=["CPUExecutionProvider"])
    prompt = [5, 17, 42, 99, 7, 3, 250, 11, 64, 12]  # longer than Mistral's tiny sliding window of 8
    got = _greedy_with_ort(session, interface["layers"], interface["kv_heads"], interface["head_dim"], prompt, 12)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[family]).eval()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == expected


def test_logits_all_and_weights_in_external_data(tiny_checkpoints, tmp_path):
    # Every graph keeps its weights in model.onnx.data (mapped by ONNX Runtime, never serialized whole).
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["qwen2"])
    recipe.write_text(recipe.read_text().replace("logits: last", "logits: all"))
    folder = compile_recipe(recipe, tmp_path / "out")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert "variants/cpu-fp32/model.onnx.data" in manifest["files"]
    assert manifest["interface"]["outputs"][0]["shape"] == ["batch", "seq", 320]
    entry = manifest["variants"]["cpu-fp32"]
    assert "variants/cpu-fp32/model.onnx.data" in entry["files"]
    backend = OnnxRuntimeBackend(folder / entry["model"], entry["interface"])  # the fused graph's shared KV buffers
    logits, _ = backend.run(np.array([[1, 2, 3]]), np.ones((1, 3), np.int64), np.array([[0, 1, 2]]),
                            backend.new_cache(1, 3))
    assert logits.shape == (1, 3, 320)


def test_interrupted_compile_leaves_nothing(tiny_checkpoints, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # as if Ctrl-C arrived between export and validation

    monkeypatch.setattr(compiler.pipeline, "validate_export", interrupted)
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"])
    with pytest.raises(KeyboardInterrupt):
        compile_recipe(recipe, tmp_path / "out" / "art")
    assert list((tmp_path / "out").iterdir()) == []


def test_failed_compile_keeps_the_previous_artifact(tiny_checkpoints, tmp_path, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["gpt2"])
    folder = compile_recipe(recipe, tmp_path / "art")
    before = (folder / "manifest.json").read_text()
    # A tolerance no real fp32 pair can meet: the compile must fail with the numbers, not warn.
    monkeypatch.setattr(compiler.validate_export, "RELATIVE_TOLERANCE", 1e-12)
    with pytest.raises(ExportMismatch, match=r"beyond the fp32 tolerance 1e-12 in case .*logits max abs .*present KV"):
        compile_recipe(recipe, tmp_path / "art")
    assert (folder / "manifest.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "r.yaml"]


def test_a_disk_that_fills_mid_compile_is_one_line_and_keeps_the_previous_artifact(tiny_checkpoints, tmp_path):
    """compile-model --no-disk-check onto a 64 MiB tmpfs (root only) filled to its last MiB: one line naming
    the folder and the free space, exit 1, no partial folder, the artifact compiled there before intact;
    with the room back, the same command compiles."""
    import os
    import subprocess
    import sys

    with small_tmpfs(tmp_path / "disk", "64m") as disk:
        recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"])
        command = [sys.executable, "-m", "compiler.cli", str(recipe), "--out", str(disk / "art"), "--no-disk-check"]
        first = subprocess.run(command, capture_output=True, text=True)
        assert first.returncode == 0, first.stderr
        before = {p.relative_to(disk): p.read_bytes() for p in (disk / "art").rglob("*") if p.is_file()}
        ballast = disk / "ballast"
        with open(ballast, "wb") as handle:  # all but the last MiB
            handle.truncate(shutil.disk_usage(disk).free - (1 << 20))
            os.posix_fallocate(handle.fileno(), 0, handle.seek(0, 2))
        full = subprocess.run(command, capture_output=True, text=True)
        assert full.returncode == 1, full.stderr
        last = full.stderr.strip().splitlines()[-1]
        assert last.startswith(f"compile-model: error: --out {disk / 'art'}: its file system filled while the compile "
                               "wrote the artifact (") and "nothing was written" in last
        assert sorted(p.name for p in disk.iterdir()) == ["art", "ballast"]  # no partial folder
        assert {p.relative_to(disk): p.read_bytes() for p in (disk / "art").rglob("*") if p.is_file()} == before
        ballast.unlink()
        again = subprocess.run(command, capture_output=True, text=True)
        assert again.returncode == 0, again.stderr


def test_context_beyond_the_model_is_refused(tiny_checkpoints, tmp_path):
    from compiler.errors import RecipeError

    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["gpt2"])
    recipe.write_text(recipe.read_text().replace("max_context: 128", "max_context: 4096"))
    with pytest.raises(RecipeError, match="export.max_context: 4096 exceeds the model's max_position_embeddings 256"):
        compile_recipe(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_max_context_defaults_to_the_models_own_limit(tiny_checkpoints, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["gpt2"])  # a 256-position table
    recipe.write_text(recipe.read_text().replace("max_context: 128, ", ""))
    manifest = json.loads((compile_recipe(recipe, tmp_path / "out") / "manifest.json").read_text())
    assert manifest["model"]["max_context"] == 256 and manifest["recipe"]["export"]["max_context"] == 256


def test_tampered_artifact_is_refused(tiny_artifacts, tmp_path):
    import shutil

    copy = shutil.copytree(tiny_artifacts["llama"], tmp_path / "copy")
    Artifact.open(copy)  # verifies
    with open(copy / "tokenizer" / "tokenizer.json", "a") as handle:
        handle.write(" ")
    with pytest.raises(ArtifactError, match="tokenizer/tokenizer.json has the wrong size"):
        Artifact.open(copy)


def test_output_over_a_foreign_folder_is_refused(tiny_checkpoints, tmp_path):
    import subprocess
    import sys

    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"])
    result = subprocess.run([sys.executable, "-m", "compiler.cli", str(recipe), "--out", str(precious)],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "a folder that is not a Kiln artifact is already there; choose a new folder" in result.stderr
    assert (precious / "notes.txt").read_text() == "keep me"




def test_validation_reference_is_transformers_own_attention(tiny_checkpoints, tmp_path, monkeypatch):
    import compiler.attention

    original = compiler.attention.grouped_attention

    def unscaled(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        return original(module, query, key, value, attention_mask, 1.0)

    # A bug in the export-only attention must fail the compile, not be traced into both sides. The
    # torch stages run here, not in their own process, so that they see the patched attention.
    monkeypatch.setattr(compiler.attention, "grouped_attention", unscaled)
    monkeypatch.setattr(compiler.pipeline, "in_child_process", lambda function, *args: function(*args))
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"])
    with pytest.raises(ExportMismatch):
        compile_recipe(recipe, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_sharded_bf16_checkpoint_compiles_and_records_stage_memory(tmp_path):
    """Checkpoints as users have them: bf16 weights in shards with an index (as the hub ships 1B+ models)."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.generator import Generator
    from runtime.sampling import SamplingParams
    from tests.conftest import build_tiny_checkpoint

    source = build_tiny_checkpoint("llama", tmp_path / "fp32")
    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    model.save_pretrained(sharded, max_shard_size="40KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            (sharded / name).write_bytes((source / name).read_bytes())
    shards = sorted(p.name for p in sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (sharded / "model.safetensors.index.json").is_file()
    assert json.loads((sharded / "config.json").read_text())["dtype"] == "bfloat16"

    artifact = compile_recipe(write_recipe(tmp_path / "r.yaml", sharded, name="sharded"), tmp_path / "art")
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["export"]["validation"]["top1_agreement"] == 1.0
    assert manifest["variants"]["cpu-fp32"]["status"] == "built"
    peaks = manifest["compile"]["stage_peak_rss_mib"]
    assert {"load", "export", "validate export", "reference", "variant cpu-fp32"} <= set(peaks)
    # MiB of a whole Python process with torch and onnxruntime loaded: neither bytes nor GiB
    assert all(100 < peak < 20_000 for peak in peaks.values()), peaks
    assert manifest["compile"]["peak_rss_mib"] >= max(peaks.values())
    # The bf16 weights, widened to fp32, are what the graph computes with: greedy equals eager's.
    eager = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32).eval()
    generator = Generator.load(artifact)
    ids = generator.encode("The quick brown fox")
    with torch.no_grad():
        expected = eager.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=0,
                                  pad_token_id=0)[0, len(ids):].tolist()
    got = generator.generate([ids], SamplingParams(max_new_tokens=8))[0].token_ids
    assert got == (expected[: expected.index(0) + 1] if 0 in expected else expected)


def test_no_torch_weights_outlive_the_reference_stage(tiny_checkpoints, tmp_path, monkeypatch):
    """Once the torch stages are done, none of the model's parameters may stay alive in the process that
    ran them: onnxscript's pattern matchers kept the exported graph, and through it every parameter,
    until the compile ended. The stages run here (not in their own process, which would hide it)."""
    import gc
    import weakref

    parameters, alive = [], []

    def loading(*args, **kwargs):
        checkpoint = load(*args, **kwargs)
        parameters.extend(weakref.ref(p) for p in checkpoint.model.parameters())
        return checkpoint

    def validating(*args, **kwargs):
        gc.collect()
        alive.append(sum(ref() is not None for ref in parameters))
        return validate(*args, **kwargs)

    load, validate = compiler.pipeline.load_checkpoint, compiler.pipeline.validate_export
    monkeypatch.setattr(compiler.pipeline, "load_checkpoint", loading)
    monkeypatch.setattr(compiler.pipeline, "validate_export", validating)
    monkeypatch.setattr(compiler.pipeline, "in_child_process", lambda function, *args: function(*args))
    compile_recipe(write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"]), tmp_path / "out")
    assert parameters and alive == [0]


@pytest.mark.parametrize("family", ["llama", "falcon"])  # falcon: its trace needs real values, so it is traced with them
def test_export_leaves_the_model_without_weights_and_writes_them_unchanged(tiny_checkpoints, tmp_path, family):
    from compiler.export import SCRATCH_WEIGHTS_FILE, export
    from compiler.load import load_checkpoint
    from compiler.recipe import load_recipe

    recipe, _ = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_checkpoints[family]))
    checkpoint = load_checkpoint(recipe.model)
    weights = [p.detach().numpy().copy() for p in checkpoint.model.parameters()]
    exported = export(checkpoint, recipe.export, tmp_path / "export")
    assert {p.device.type for p in checkpoint.model.parameters()} == {"meta"}  # freed: the export was its last use
    assert not (tmp_path / "export" / SCRATCH_WEIGHTS_FILE).exists()
    graph = onnx.load(str(exported.model_path))
    initializers = [onnx.numpy_helper.to_array(i) for i in graph.graph.initializer]
    for weight in weights:  # each weight is in the graph as it was, or transposed for MatMul
        assert any(np.array_equal(weight, i) or (weight.ndim == 2 and np.array_equal(weight.T, i))
                   for i in initializers), weight.shape
