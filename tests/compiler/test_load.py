"""Checkpoint sources: HF folder (safetensors; pickle only on request), local hub cache, package: paths."""

from __future__ import annotations

import shutil

import numpy as np
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


def test_sharded_bf16_is_held_in_bf16_and_computes_as_fp32(tiny_checkpoints, tmp_path, family):
    """The load stage reads safetensors shards with pread instead of transformers' mapping (the mapped
    pages counted in the resident set beside the model) and keeps bf16 weights as bf16, widened to fp32
    module by module as the model runs: the same weights, tied ones tied, the folder's
    generation_config.json still read, and the logits of the model loaded in fp32."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from compiler.eager import EagerBackend
    from compiler.fp32_compute import computes_in_fp32

    source = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[family], dtype=torch.bfloat16)
    source.generation_config.max_new_tokens = 77
    folder = tmp_path / "sharded"
    source.save_pretrained(folder, max_shard_size="30KB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoints[family] / name, folder / name)
    assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 3

    checkpoint = load_checkpoint(ModelSpec(source=str(folder)), keep_narrow_weights=True)
    with _safetensors_read_by_pread(checkpoint.source, checkpoint.config) as read:
        assert read is not None and read[1] == "bfloat16"  # read by pread, not by transformers' own mapping
    loaded = checkpoint.model
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert loaded.generation_config.max_new_tokens == 77
    ours, theirs = loaded.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, weight in ours.items():
        assert torch.equal(weight.float(), theirs[name]), name
    # Held narrow unless a buffer built with the model came out narrow (Gemma's embedding scale,
    # rounded to bf16 at construction), which widening could not undo: then loaded in fp32.
    narrow_buffer = any(b.is_floating_point() and b.dtype != torch.float32 for b in source.buffers())
    held = torch.float32 if narrow_buffer else torch.bfloat16
    assert {p.dtype for p in loaded.parameters()} == {held}
    assert all(b.dtype == torch.float32 for b in loaded.buffers() if b.is_floating_point())
    embedding, head = loaded.get_input_embeddings().weight, loaded.get_output_embeddings().weight
    assert (embedding.data_ptr() == head.data_ptr()) == bool(loaded.config.tie_word_embeddings)

    ids, mask = np.array([[5, 9, 2, 7, 1, 3, 8]] * 2), np.ones((2, 7), np.int64)
    mask[1, :3] = 0
    positions = np.clip(mask.cumsum(-1) - 1, 0, None)
    ours_backend, theirs_backend = EagerBackend(loaded), EagerBackend(reference)
    ours_logits, _ = ours_backend.run(ids, mask, positions, ours_backend.new_cache(2, 7))
    theirs_logits, _ = theirs_backend.run(ids, mask, positions, theirs_backend.new_cache(2, 7))
    # The same fp32 values through the same ops; a GEMM kernel may still round a product differently for
    # the two weights' allocations (one fp32 rounding, 6e-8 measured), where any real difference, a
    # weight or buffer left in bf16, moves logits by 1e-3 or more.
    rows = ours_backend.forward_row([5, 9, 2, 7]), theirs_backend.forward_row([5, 9, 2, 7])
    for ours_out, theirs_out in ((ours_logits, theirs_logits), rows):
        assert ours_out.dtype == np.float32
        np.testing.assert_allclose(ours_out, theirs_out, rtol=0, atol=1e-6 * np.abs(theirs_out).max())
    assert {p.dtype for p in loaded.parameters()} == {held}  # the fp32 copies are gone
    plain = load_checkpoint(ModelSpec(source=str(folder))).model  # compare-model's: fp32, as transformers loads it
    assert {p.dtype for p in plain.parameters()} == {torch.float32} and not computes_in_fp32(plain)
