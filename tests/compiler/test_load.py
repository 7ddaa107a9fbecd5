"""Checkpoint sources: HF folder (safetensors; pickle only on request), local hub cache, package: paths."""

from __future__ import annotations

import shutil

import pytest

from compiler.errors import CheckpointError
from compiler.load import _safetensors_read_by_pread, load_checkpoint, resolve_source
from compiler.recipe import ModelSpec


def _pickle_only_copy(src, dst):
    import torch
    from safetensors.torch import load_file

    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    torch.save(state, dst / "pytorch_model.bin")
    return dst


def test_folder_loads_with_tokenizer(tiny_checkpoints):
    checkpoint = load_checkpoint(ModelSpec(source=str(tiny_checkpoints["llama"])))
    assert checkpoint.source.kind == "folder"
    assert checkpoint.family.name == "Llama"
    assert checkpoint.tokenizer.is_fast and len(checkpoint.source_sha256) == 64
    assert not checkpoint.model.training


def test_pickle_weights_refused_unless_allowed(tiny_checkpoints, tmp_path):
    folder = _pickle_only_copy(tiny_checkpoints["qwen2"], tmp_path / "pickled")
    with pytest.raises(CheckpointError, match="only pickle weights .* set model.allow_pickle: true"):
        load_checkpoint(ModelSpec(source=str(folder)))
    loaded = load_checkpoint(ModelSpec(source=str(folder), allow_pickle=True))
    reference = load_checkpoint(ModelSpec(source=str(tiny_checkpoints["qwen2"])))
    for (name, a), (_, b) in zip(loaded.model.state_dict().items(), reference.model.state_dict().items(), strict=True):
        assert (a == b).all(), name


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="has no config.json, so it is not a Hugging Face model folder"):
        load_checkpoint(ModelSpec(source=str(tmp_path)))


def test_folder_without_weights(tiny_checkpoints, tmp_path):
    shutil.copy(tiny_checkpoints["llama"] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_checkpoint(ModelSpec(source=str(tmp_path)))


def test_hub_id_from_local_cache(tiny_checkpoints, tmp_path, monkeypatch):
    import huggingface_hub.constants

    # The real cache layout: refs/main names a snapshot folder holding the files.
    repo = tmp_path / "hub" / "models--tiny-org--tiny-gpt2"
    commit = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_checkpoints["gpt2"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    checkpoint = load_checkpoint(ModelSpec(source="tiny-org/tiny-gpt2"))
    assert checkpoint.source.kind == "hub-cache"
    assert checkpoint.source.path.name == commit
    assert checkpoint.family.name == "GPT-2"


def test_hub_id_not_cached_is_not_downloaded(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache, and Kiln never downloads"):
        resolve_source(ModelSpec(source="nobody/nothing"))


def test_package_source_errors():
    with pytest.raises(CheckpointError, match="package 'no_such_pkg_kiln' is not installed"):
        resolve_source(ModelSpec(source="package:no_such_pkg_kiln/model.gguf"))
    with pytest.raises(CheckpointError, match="package pytest has no file nope.gguf"):
        resolve_source(ModelSpec(source="package:pytest/nope.gguf"))
    with pytest.raises(CheckpointError, match="expected package:<module>/<file"):
        resolve_source(ModelSpec(source="package:pytest"))


def test_single_non_gguf_file_refused(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="a single file must be a .gguf checkpoint"):
        resolve_source(ModelSpec(source=str(tmp_path / "weights.safetensors")))


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or folder"):
        resolve_source(ModelSpec(source=str(tmp_path / "none" / "x" / "y")))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sharded_bf16_read_by_pread_equals_from_pretrained(tiny_checkpoints, tmp_path, family):
    """The load stage reads safetensors shards with pread instead of transformers' mapping (the mapped
    pages counted in the resident set beside the fp32 model): the same fp32 weights, tied ones tied,
    and the folder's generation_config.json still read."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    source = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[family], dtype=torch.bfloat16)
    source.generation_config.max_new_tokens = 77
    folder = tmp_path / "sharded"
    source.save_pretrained(folder, max_shard_size="30KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoints[family] / name, folder / name)
    assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 3

    checkpoint = load_checkpoint(ModelSpec(source=str(folder)))
    with _safetensors_read_by_pread(checkpoint.source, checkpoint.config) as load:
        assert load is not None  # this folder is read by pread, not by transformers' own mapping
    loaded = checkpoint.model
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert loaded.generation_config.max_new_tokens == 77
    ours, theirs = loaded.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, weight in ours.items():
        assert weight.dtype == torch.float32 and torch.equal(weight, theirs[name]), name
    embedding, head = loaded.get_input_embeddings().weight, loaded.get_output_embeddings().weight
    assert (embedding.data_ptr() == head.data_ptr()) == bool(loaded.config.tie_word_embeddings)
