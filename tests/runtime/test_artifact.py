"""What the runtime refuses before loading a model, and what a production host must install."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from runtime.artifact import Artifact
from runtime.errors import ArtifactError, IncompatibleArtifact

ROOT = Path(__file__).resolve().parents[2]


def _run_model(*args):
    return subprocess.run([sys.executable, "-m", "runtime.cli", *map(str, args)], capture_output=True, text=True)


def test_runtime_install_has_no_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime_deps = project["dependencies"] + project["optional-dependencies"]["cpu"] + \
        project["optional-dependencies"]["gpu"]
    names = {d.split("=")[0].split(">")[0].split("<")[0].strip().lower() for d in runtime_deps}
    assert not names & {"torch", "transformers", "onnx", "onnxscript", "accelerate"}
    assert "torch==2.13.0" in project["optional-dependencies"]["compiler"]


def test_newer_schema_is_incompatible(tiny_artifacts, tmp_path):
    copy = shutil.copytree(tiny_artifacts["gpt2"], tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(IncompatibleArtifact, match="manifest schema version 99, this runtime reads versions 1 and 2"):
        Artifact.open(copy)
    result = _run_model(copy, "--prompt", "x")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_missing_file_and_missing_artifact(tiny_artifacts, tmp_path):
    copy = shutil.copytree(tiny_artifacts["gpt2"], tmp_path / "copy")
    (copy / "tokenizer" / "generation_config.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer/generation_config.json listed in the manifest is missing"):
        Artifact.open(copy)
    result = _run_model(tmp_path / "nothing", "--prompt", "x")
    assert result.returncode == 2
    assert result.stderr.strip() == f"run-model: error: {tmp_path / 'nothing'}: not a Kiln artifact (no manifest.json)"


def test_unknown_variant_and_provider(tiny_artifacts):
    from runtime.generator import Generator

    with pytest.raises(IncompatibleArtifact, match="no built variant 'gpu'; built variants: cpu-fp32"):
        Generator.load(tiny_artifacts["gpt2"], variant="gpu")
    with pytest.raises(IncompatibleArtifact, match=r"variant 'cpu-fp32' is built for the CPU \(target onnxruntime\), "
                                                   "not for CUDA: run it with --device cpu"):
        Generator.load(tiny_artifacts["gpt2"], providers=["CUDAExecutionProvider"])



def test_an_artifact_of_variants_that_missed_their_gates_names_them(tiny_artifacts, tmp_path):
    """compile-model --keep-failed can leave no built variant: a wrong name says which ones it has."""
    copy = shutil.copytree(tiny_artifacts["gpt2"], tmp_path / "copy")
    manifest = json.loads((copy / "manifest.json").read_text())
    for entry in manifest["variants"].values():
        entry["status"] = "failed"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    artifact = Artifact.open(copy, verify=False)
    with pytest.raises(IncompatibleArtifact, match="no variant 'gpu'; the artifact holds no built variant; variants "
                                                   "that missed their gates load only when named: cpu-fp32"):
        artifact.variant("gpu")
    assert artifact.variant("cpu-fp32").name == "cpu-fp32"

def test_prompts_file_and_chat(tiny_artifacts, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "The quick"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    result = _run_model(tiny_artifacts["llama"], "--prompts-file", prompts, "--max-new-tokens", "3",
                        "--output", tmp_path / "o.jsonl")
    assert result.returncode == 0, result.stderr
    rows = sorted((json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()),
                  key=lambda row: row["index"])
    assert len(rows) == 2 and all(r["generated_tokens"] >= 1 for r in rows)
    assert rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"]  # the chat template added its markers
