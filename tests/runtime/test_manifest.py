"""runtime/manifest.py: what the typed manifest refuses (one line each), what it reads from schema 1
and 2, and that compile-model cannot write a manifest the runtime refuses."""

from __future__ import annotations

import copy
import json

import pytest

from runtime.errors import ArtifactError, IncompatibleArtifact
from runtime.manifest import Interface, Manifest, ManifestError, Variant

INTERFACE = {
    "inputs": [{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]},
               {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "past + seq"]},
               {"name": "position_ids", "dtype": "int64", "shape": ["batch", "seq"]},
               {"name": "past_key_values.{layer}.key", "dtype": "float32", "shape": ["batch", 2, "past", 16]},
               {"name": "past_key_values.{layer}.value", "dtype": "float32", "shape": ["batch", 2, "past", 16]}],
    "outputs": [{"name": "logits", "dtype": "float32", "shape": ["batch", 1, 320]},
                {"name": "present.{layer}.key", "dtype": "float32", "shape": ["batch", 2, "past + seq", 16]},
                {"name": "present.{layer}.value", "dtype": "float32", "shape": ["batch", 2, "past + seq", 16]}],
    "layers": 2, "kv_heads": 2, "head_dim": 16, "vocab_size": 320, "kv_sharing": "none",
}
FILE = {"sha256": "0" * 64, "size": 1}


def document(**changes):
    """A schema-1 manifest as compile-model writes one: a built fp32 variant with its graph and data."""
    manifest = {
        "schema_version": 1, "created": "2026-12-07T00:00:00+00:00", "name": "tiny",
        "model": {"family": "Llama", "max_context": 128, "eos_token_ids": [0], "bos_token_id": 0, "pad_token_id": None},
        "recipe": {"export": {"opset": 18}},
        "variants": {"cpu-fp32": {"target": "onnxruntime", "precision": "fp32", "quantize": None, "status": "built",
                                  "interface": copy.deepcopy(INTERFACE), "model": "variants/cpu-fp32/model.onnx",
                                  "files": ["variants/cpu-fp32/model.onnx", "variants/cpu-fp32/model.onnx.data"],
                                  "accuracy": {"top1_agreement": 1.0}}},
        "files": {"tokenizer/tokenizer.json": FILE, "variants/cpu-fp32/model.onnx": FILE,
                  "variants/cpu-fp32/model.onnx.data": FILE},
    }
    manifest.update(changes)
    return manifest


def refusal(manifest) -> str:
    with pytest.raises(ArtifactError) as refused:
        Manifest.parse(manifest, "art")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("art: ")
    return message


def test_a_manifest_reads_as_typed_fields():
    manifest = Manifest.parse(document())
    variant = manifest.variants["cpu-fp32"]
    assert (manifest.name, manifest.schema_version, manifest.model.max_context) == ("tiny", 1, 128)
    assert manifest.model.eos_token_ids == (0,) and manifest.files["variants/cpu-fp32/model.onnx"].size == 1
    assert variant.built and variant.model == "variants/cpu-fp32/model.onnx" and variant.kernel_model is None
    assert variant.files == ("variants/cpu-fp32/model.onnx", "variants/cpu-fp32/model.onnx.data")
    assert variant.document["accuracy"] == {"top1_agreement": 1.0}  # the build's record, kept as written
    assert manifest.to_json() == document()
    interface = variant.interface
    assert (interface.layers, interface.kv_dtype, interface.logits_dtype, interface.shared_buffers) == \
        (2, "float32", "float32", False)
    assert [spec.name for spec in interface.past] == ["past_key_values.{layer}.key", "past_key_values.{layer}.value"]
    assert interface.with_kv_dtype("float16").kv_dtype == "float16" and interface.kv_dtype == "float32"
    assert Interface.of(interface.to_json()) == interface
    with pytest.raises(AttributeError):
        variant.status = "failed"  # frozen: what the runtime acts on cannot drift from what it checked


def test_schema_2_reads_and_marks_a_variant_for_the_kernels_alone():
    variants = document()["variants"]
    variants["cpu-fp32"].update({"cpu_kernels": "required", "kernel_model": "variants/cpu-fp32/model_kernels.onnx",
                                 "model_failed_gates": ["top1_agreement 0.9 < 0.95"]})
    files = {**document()["files"], "variants/cpu-fp32/model_kernels.onnx": FILE}
    variant = Manifest.parse(document(schema_version=2, variants=variants, files=files)).variants["cpu-fp32"]
    assert variant.cpu_kernels == "required" and variant.model_failed_gates == ("top1_agreement 0.9 < 0.95",)


def test_a_schema_this_runtime_does_not_read_is_incompatible():
    with pytest.raises(IncompatibleArtifact, match="manifest schema version 3, this runtime reads versions 1 and 2"):
        Manifest.parse(document(schema_version=3), "art")


@pytest.mark.parametrize(("change", "says"), [
    (lambda m: m.update(name="Tiny Model"), "the manifest's name 'Tiny Model' is not [a-z0-9][a-z0-9._-]*"),
    (lambda m: m.update(files={}), "the manifest lists no files"),
    (lambda m: m["files"].update({"../outside": FILE}), "the manifest lists '../outside', a path that climbs out"),
    (lambda m: m["files"].update({"manifest.json": FILE}), "the manifest lists 'manifest.json', a reserved name"),
    (lambda m: m["files"].update({"x": {"size": -1, "sha256": "0"}}), "the manifest's entry for 'x' has no valid"),
    (lambda m: m["model"].pop("max_context"), "the manifest's model facts have no max_context"),
    (lambda m: m["variants"]["cpu-fp32"].update(status="half"), "variant 'cpu-fp32' has status 'half', not one of"),
    (lambda m: m["variants"]["cpu-fp32"].update(model="variants/other/model.onnx"),
     "variant 'cpu-fp32' points at 'variants/other/model.onnx' (model), which the manifest does not list"),
    (lambda m: m["variants"]["cpu-fp32"].update(kernel_model="variants/cpu-fp32/model_kernels.onnx"),
     "(kernel_model), which the manifest does not list"),
    (lambda m: m["variants"]["cpu-fp32"].update(engine={"profiles_file": "p.json"}),
     "variant 'cpu-fp32' has an engine entry without a file"),
    (lambda m: m["variants"]["cpu-fp32"].pop("interface"), "variant 'cpu-fp32' is built but has no interface"),
    (lambda m: m["variants"]["cpu-fp32"]["interface"].pop("kv_heads"), "has an interface without a valid 'kv_heads'"),
    (lambda m: m["variants"]["cpu-fp32"].pop("model"), "is built but names no file to run (model or engine)"),
    (lambda m: m["variants"]["cpu-fp32"].update(kv_row_graphs=5), "has kv_row_graphs that is not a list of strings"),
    (lambda m: m["variants"]["cpu-fp32"].update(files=["/etc/passwd"]),
     "points at '/etc/passwd' (files), which the manifest does not list"),  # export-for would link it
    (lambda m: m["variants"]["cpu-fp32"].update(sidecars=[["x"]]), "has sidecars that is not a list of strings"),
    (lambda m: m["variants"]["cpu-fp32"].update(memory={"weights_bytes": "many"}), "memory figures that are not"),
    (lambda m: m["variants"]["cpu-fp32"].update(quantize="int4"), "has a quantize that is not a dict"),
])
def test_an_unsafe_or_incomplete_manifest_is_refused_in_one_line(change, says):
    manifest = document()
    change(manifest)
    assert says in refusal(manifest)


def test_a_skipped_or_failed_variant_needs_no_file_to_run():
    """A TensorRT variant whose engine could not be built here records why; it is listed, never run."""
    variants = {"trt-fp16": {"target": "tensorrt", "status": "skipped", "reason": "TensorRT is not installed"}}
    variant = Manifest.parse(document(variants=variants)).variants["trt-fp16"]
    assert not variant.built and variant.why_not_built() == "TensorRT is not installed"


def test_a_manifest_that_is_not_an_object_is_refused():
    assert "not a JSON object" in refusal(["schema_version", 1])


def test_compile_model_cannot_write_a_manifest_the_runtime_refuses(tmp_path):
    """compiler/package.py parses what it writes with the runtime's checks: nothing is written on a refusal."""
    pytest.importorskip("torch", reason="compiler/package.py is the build machine's (the compiler extra)")
    from compiler.package import write_manifest
    from compiler.progress import StageLog

    (tmp_path / "variants" / "cpu-fp32").mkdir(parents=True)
    (tmp_path / "variants" / "cpu-fp32" / "model.onnx").write_bytes(b"x")
    sections = {key: value for key, value in document().items()
                if key not in ("schema_version", "created", "files")}
    sections["variants"]["cpu-fp32"]["files"] = ["variants/cpu-fp32/model.onnx"]
    sections["variants"]["cpu-fp32"]["model"] = "variants/cpu-fp32/missing.onnx"
    with pytest.raises(ManifestError, match="points at 'variants/cpu-fp32/missing.onnx' \\(model\\), which the "
                                            "manifest does not list"):
        write_manifest(tmp_path, sections, StageLog(quiet=True))
    assert not (tmp_path / "manifest.json").exists()
    sections["variants"]["cpu-fp32"]["model"] = "variants/cpu-fp32/model.onnx"
    written = write_manifest(tmp_path, sections, StageLog(quiet=True))
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk == written.to_json() and on_disk["schema_version"] == 1
    assert set(on_disk["files"]) == {"variants/cpu-fp32/model.onnx"}


def test_a_variant_of_an_entry_held_by_a_compile_step():
    entry = Variant.of("trt-fp32", {"status": "built", "target": "tensorrt", "engine": {"file": "e.plan"}})
    assert entry.engine == {"file": "e.plan"} and entry.model is None and entry.failed_gates == ()
