"""The artifact folder as the runtime sees it: manifest.json, verified before anything is loaded.

    <artifact>/
      manifest.json          schema version, source, recipe, tools, interface, variants, files
      tokenizer/             tokenizer.json, tokenizer_config.json, generation_config.json
      variants/<name>/       model.onnx (+ model.onnx.data)
      reports/               validation reports
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .errors import ArtifactError, IncompatibleArtifact
from .files import read_utf8
from .manifest import MANIFEST, SIGNATURE_FILE, FileEntry, Manifest, Variant, safe_relative
from .onnx_refs import MalformedModel, external_data

_CHUNK = 1 << 20


def sha256_file(path: Path, on_bytes: Any = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return digest.hexdigest()


def version_tuple(text: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string, as far as it has them: "1.32.0+cpu" -> (1, 32, 0),
    "10.13.0.35" -> (10, 13, 0)."""
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@dataclass(frozen=True)
class Artifact:
    folder: Path
    manifest: Manifest

    @classmethod
    def open(cls, folder: str | Path, verify: bool = True) -> Artifact:
        """Read and check the manifest (runtime/manifest.py) and, by default, every listed file's size and
        sha256."""
        folder = Path(folder)
        path = folder / MANIFEST
        if not path.is_file():
            raise ArtifactError(f"{folder}: not a Kiln artifact (no {MANIFEST})")
        try:
            document = json.loads(read_utf8(path, str(path), "JSON", ArtifactError))
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        artifact = cls(folder, Manifest.parse(document, str(folder)))
        if verify:
            artifact.verify()
        return artifact

    def verify(self, use_cache: bool = True, rehash: bool = True) -> list[str]:
        """The one integrity check, shared by loading and `kiln verify`: a manifest safe to act on, no
        file it does not list, every listed file's size and sha256, and external-data references that
        stay inside the artifact. Returns what was checked, one note a check. When loading, a file
        hashed before is trusted again while its size, mtime, ctime (ns; ctime cannot be set back),
        inode and device are unchanged; the cache lives in ~/.cache/kiln, not in the artifact.
        `kiln verify` and `install` never use it."""
        files = self.manifest.files
        _check_tree(self.folder, set(files))
        if rehash:
            self._check_hashes(_HashCache.load() if use_cache else _HashCache(None, {}))
        notes = [f"schema {self.manifest.schema_version}, {len(files)} files, sha256 and size of each"]
        models = {v.model for v in self.manifest.variants.values() if v.model is not None}
        onnx_files = sorted({name for name in files if name.endswith(".onnx")} | models)
        for name in onnx_files:
            _check_external_data(self.folder, name, files)
        notes.append(f"external data of {len(onnx_files)} ONNX file(s) inside the artifact and within its files")
        return notes

    def _check_hashes(self, cache: _HashCache) -> None:
        for relative, entry in self.manifest.files.items():
            path = self.folder / relative
            if not path.is_file():
                raise ArtifactError(f"{self.folder}: file {relative} listed in the manifest is missing")
            stat = path.stat()
            if stat.st_size != entry.size:
                raise ArtifactError(f"{self.folder}: file {relative} has the wrong size (modified after compile)")
            if cache.get(path, stat) != entry.sha256:
                digest = sha256_file(path)
                if digest != entry.sha256:
                    raise ArtifactError(
                        f"{self.folder}: file {relative} fails its sha256 check (modified after compile)")
                cache.put(path, stat, digest)
        cache.save()

    def variant(self, name: str | None = None) -> Variant:
        """A built variant's manifest entry; without a name, the first one built (runtime/backends/registry.py
        runnable_variant: the first this host runs). A variant that missed its accuracy gates (kept by
        compile-model --keep-failed) loads only when named."""
        variants = self.manifest.variants
        asked = variants.get(name) if name is not None else None
        if asked is not None and asked.status == "failed":
            return asked
        built = self.manifest.built()
        if asked is not None and asked.status == "skipped":
            others = f"; built variants: {', '.join(built)}" if built else ""
            raise IncompatibleArtifact(f"{self.folder}: variant {name!r} was not built: {asked.reason}" + others)
        if not built:
            failed = [n for n, v in variants.items() if v.status == "failed"]
            named = f"no variant {name!r}; " if name is not None else ""
            kept = f"; variants that missed their gates load only when named: {', '.join(failed)}" if failed else ""
            raise IncompatibleArtifact(f"{self.folder}: {named}the artifact holds no built variant{kept}")
        if name is None:
            return next(iter(built.values()))
        if name not in built:
            raise IncompatibleArtifact(
                f"{self.folder}: no built variant {name!r}; built variants: {', '.join(built)}"
            )
        return built[name]

    @property
    def tokenizer_dir(self) -> Path:
        return self.folder / "tokenizer"

    @property
    def generation_config(self) -> dict[str, Any]:
        """tokenizer/generation_config.json, or {} where the checkpoint had none."""
        path = self.tokenizer_dir / "generation_config.json"
        return json.loads(path.read_text()) if path.is_file() else {}


class _HashCache:
    """{absolute path: [size, mtime_ns, ctime_ns, inode, device, sha256]} of files hashed before."""

    def __init__(self, path: Path | None, entries: dict[str, list]) -> None:
        self.path, self.entries, self.changed = path, entries, False

    @classmethod
    def load(cls) -> _HashCache:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        path = root / "kiln" / "verified-files.json"
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            entries = {}
        return cls(path, entries if isinstance(entries, dict) else {})

    @staticmethod
    def _key(stat: os.stat_result) -> list:
        return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]

    def get(self, path: Path, stat: os.stat_result) -> str | None:
        entry = self.entries.get(str(path.resolve()))
        return entry[5] if isinstance(entry, list) and len(entry) == 6 and entry[:5] == self._key(stat) else None

    def put(self, path: Path, stat: os.stat_result, digest: str) -> None:
        self.entries[str(path.resolve())] = [*self._key(stat), digest]
        self.changed = True

    def save(self) -> None:
        if not self.changed or self.path is None:
            return
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:  # a read-only home only costs the next load its hashing
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            partial.unlink(missing_ok=True)
            descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                handle.write(json.dumps(self.entries))
            os.replace(partial, self.path)
        except OSError:
            partial.unlink(missing_ok=True)


# -- the checks verify() makes ------------------------------------------------------------------

def _check_tree(folder: Path, listed: set[str]) -> None:
    allowed = listed | {MANIFEST, SIGNATURE_FILE}
    for root, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = Path(root) / name
            relative = path.relative_to(folder).as_posix()
            if path.is_symlink():
                raise ArtifactError(f"{folder}: {relative} is a symbolic link; an artifact holds none")
            if name in names and relative not in allowed:
                raise ArtifactError(f"{folder}: file {relative} is not listed in the manifest")


def _check_external_data(folder: Path, name: str, files: Mapping[str, FileEntry]) -> None:
    path = folder / name
    try:
        refs = external_data(path)
    except MalformedModel as exc:
        raise ArtifactError(f"{folder}: {name} is not a readable ONNX file ({exc})") from None
    for ref in refs:
        location = ref.get("location")
        if not location:
            raise ArtifactError(f"{folder}: {name} has an external-data entry without a location; refused")
        problem = safe_relative(location)
        if problem:
            raise ArtifactError(f"{folder}: {name} keeps tensors at {location!r}, {problem}; refused")
        target = (PurePosixPath(name).parent / location).as_posix()
        if target not in files:
            raise ArtifactError(f"{folder}: {name} keeps tensors in {target}, which the manifest does not list")
        offset, length = ref.get("offset", "0"), ref.get("length")
        if length is None or not all(v.isascii() and v.isdigit() for v in (offset, length)):
            raise ArtifactError(f"{folder}: {name} has an external-data entry without a plain numeric offset and "
                                "length; refused")
        offset, length, size = int(offset), int(length), files[target].size
        if offset + length > size:
            raise ArtifactError(f"{folder}: {name} reads {target} at offset {offset} + length {length}, past its "
                                f"{size} bytes; refused")
