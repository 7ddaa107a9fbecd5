"""The package stage: tokenizer files, reports and manifest.json, in a staging folder that becomes the
artifact by one rename at the very end, so a failed or interrupted compile leaves nothing behind."""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import os
import platform
import shutil
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from runtime import __version__ as kiln_version
from runtime.artifact import sha256_file
from runtime.backends.registry import Target
from runtime.interop import portable_tokenizer_config, sidecar_files
from runtime.manifest import MANIFEST, Manifest, schema_version_for

from .errors import DiskFull
from .load import Checkpoint
from .progress import StageLog

STAGING_PREFIX = ".{}.partial-"  # + the compiling process id
TOOLS = ("torch", "transformers", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu", "tokenizers", "gguf")


@contextlib.contextmanager
def staging_folder(final: Path) -> Iterator[Path]:
    """Yield an empty sibling folder of `final`; on success it replaces `final` by rename, on any
    exception (KeyboardInterrupt included) it is deleted and `final` is left as it was."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f"{STAGING_PREFIX.format(final.name)}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if _disk_full(exc):  # said once, here, however deep in a library the write failed
            free = shutil.disk_usage(final.parent).free
            raise DiskFull(
                f"--out {final}: its file system filled while the compile wrote the artifact ({free / 2**20:.0f} MiB "
                "free now that the partial folder is gone); nothing was written and what was there before is as it "
                "was: free space, or pass --out on a larger disk") from exc
        raise
    previous = final.parent / f".{final.name}.previous-{os.getpid()}"
    if final.exists():
        final.rename(previous)
    staging.rename(final)
    shutil.rmtree(previous, ignore_errors=True)


def _disk_full(exc: BaseException) -> bool:
    """Whether an exception, or one it was raised from, is a write refused for want of space: an OSError
    (ENOSPC, EDQUOT), or a library's own error that quotes the system's message (onnx, ONNX Runtime)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def remove_stale_staging(final: Path) -> list[Path]:
    """Delete the staging folders of `final` left by compiles that were killed (kill -9, OOM killer):
    those whose process is gone. A compile still running keeps its own. Returns what was removed."""
    removed = []
    for folder in sorted(final.parent.glob(f"{STAGING_PREFIX.format(final.name)}*")):
        pid = folder.name.rpartition("-")[2]
        if folder.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_tokenizer(checkpoint: Checkpoint, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    checkpoint.tokenizer.save_pretrained(folder)
    checkpoint.model.generation_config.save_pretrained(folder)
    if not (folder / "tokenizer.json").is_file():
        raise RuntimeError("the tokenizer was saved without tokenizer.json, which the runtime needs")
    config_path = folder / "tokenizer_config.json"
    config_path.write_text(json.dumps(portable_tokenizer_config(json.loads(config_path.read_text())), indent=2) + "\n")


def write_sidecars(folder: Path, sections: dict[str, Any]) -> None:
    """config.json, genai_config.json and the tokenizer beside each onnxruntime variant's graph, so that
    Optimum and onnxruntime-genai open the variant's folder as it is (runtime/interop.py); not beside a
    model.onnx that missed its gates (a variant for Kiln's CPU kernels alone)."""
    for name, entry in sections["variants"].items():
        if entry["target"] != Target.ONNXRUNTIME or entry.get("model_failed_gates"):
            continue  # no other tool is to open that model.onnx
        files = sidecar_files(sections, name, folder / "tokenizer")
        for file, data in files.items():
            (folder / "variants" / name / file).write_bytes(data)
        entry["sidecars"] = sorted(f"variants/{name}/{file}" for file in files)


def portable_config(checkpoint: Checkpoint) -> dict[str, Any]:
    """The model's config.json as transformers 4.x and 5.x both read it. 5.x keeps the rotary base and
    fraction inside `rope_parameters`; 4.x reads them at the top level (under the family's own names)
    and the scaling from `rope_scaling`. Each version ignores the other's keys, and 5.x reads a config
    that has both the same way."""
    config = json.loads(checkpoint.config.to_json_string(use_diff=False))
    config.pop("_name_or_path", None)
    config["architectures"] = [type(checkpoint.model).__name__]
    config["torch_dtype"] = config.get("dtype") or "float32"
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" in rope:  # one set of parameters for all layers (not one per layer type)
        theta_key, fraction_key = checkpoint.family.legacy_rope_keys
        config[theta_key] = rope.pop("rope_theta")
        if "partial_rotary_factor" in rope:
            config[fraction_key] = rope.pop("partial_rotary_factor")
        config["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    return config


def model_facts(checkpoint: Checkpoint, max_context: int) -> dict[str, Any]:
    """What the runtime needs to know about the model besides the graph interface."""
    config, generation = checkpoint.config, checkpoint.model.generation_config
    eos = generation.eos_token_id if generation.eos_token_id is not None else config.eos_token_id
    eos_ids = sorted({eos} if isinstance(eos, int) else set(eos or ()))
    return {
        "family": checkpoint.family.name,
        "model_type": config.model_type,
        "architecture": type(checkpoint.model).__name__,
        "parameters": sum(p.numel() for p in checkpoint.model.parameters()),
        "max_context": max_context,
        "hidden_size": config.hidden_size,
        "attention_heads": config.num_attention_heads,
        "bos_token_id": generation.bos_token_id if generation.bos_token_id is not None else config.bos_token_id,
        "eos_token_ids": eos_ids,
        "pad_token_id": generation.pad_token_id,
        # What config.json in each variant folder is written from (runtime/interop.py).
        "config": portable_config(checkpoint),
    }


def tool_versions() -> dict[str, str]:
    versions = {"kiln": kiln_version, "python": platform.python_version()}
    for name in TOOLS:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def hash_files(folder: Path, log: StageLog) -> dict[str, dict[str, Any]]:
    """sha256 and size of every file under the folder but the manifest, keyed by relative path."""
    paths = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    total = sum(p.stat().st_size for p in paths)
    files = {}
    with log.bar("hashing files", total=total) as advance:
        for path in paths:
            files[path.relative_to(folder).as_posix()] = {
                "sha256": sha256_file(path, on_bytes=advance),
                "size": path.stat().st_size,
            }
    return files


def write_manifest(folder: Path, sections: dict[str, Any], log: StageLog) -> Manifest:
    """manifest.json, through the runtime's own checks (runtime/manifest.py): a compile that would write one
    the runtime refuses fails here, naming the problem, before the artifact takes its place."""
    manifest = Manifest.parse({
        "schema_version": schema_version_for(sections["variants"]),
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **sections,
        "tools": tool_versions(),
        "files": hash_files(folder, log),
    }, "the manifest compile-model was about to write")
    write_json(folder / MANIFEST, manifest.to_json())
    return manifest
