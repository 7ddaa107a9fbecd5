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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ArtifactError, IncompatibleArtifact

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
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
    manifest: dict[str, Any]

    @classmethod
    def open(cls, folder: str | Path, verify: bool = True) -> Artifact:
        """Read the manifest and (by default) check every listed file's size and sha256."""
        folder = Path(folder)
        path = folder / MANIFEST
        if not path.is_file():
            raise ArtifactError(f"{folder}: not a Kiln artifact (no {MANIFEST})")
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        version = manifest.get("schema_version")
        if version != SCHEMA_VERSION:
            raise IncompatibleArtifact(
                f"{folder}: manifest schema version {version}, this runtime reads version {SCHEMA_VERSION}"
            )
        artifact = cls(folder, manifest)
        if verify:
            artifact.verify()
        return artifact

    def verify(self, use_cache: bool = True) -> None:
        """Every listed file's size and sha256. When loading, a file hashed before is trusted again
        while its size, mtime, ctime (ns; ctime cannot be set back), inode and device are unchanged;
        the cache lives in ~/.cache/kiln, not in the artifact. `kiln verify` and `install` never use it."""
        cache = _HashCache.load() if use_cache else _HashCache(None, {})
        for relative, entry in self.manifest["files"].items():
            path = self.folder / relative
            if not path.is_file():
                raise ArtifactError(f"{self.folder}: file {relative} listed in the manifest is missing")
            stat = path.stat()
            if stat.st_size != entry["size"]:
                raise ArtifactError(f"{self.folder}: file {relative} has the wrong size (modified after compile)")
            if cache.get(path, stat) != entry["sha256"]:
                digest = sha256_file(path)
                if digest != entry["sha256"]:
                    raise ArtifactError(
                        f"{self.folder}: file {relative} fails its sha256 check (modified after compile)")
                cache.put(path, stat, digest)
        cache.save()

    def variant(self, name: str | None = None) -> dict[str, Any]:
        """A built variant's manifest entry; without a name, the first one built. A variant that missed
        its accuracy gates (kept by compile-model --keep-failed) loads only when named."""
        variants = self.manifest["variants"]
        status = variants.get(name, {}).get("status")
        if status == "failed":
            return {"name": name, **variants[name]}
        built = {k: v for k, v in variants.items() if v.get("status") == "built"}
        if status == "skipped":
            others = f"; built variants: {', '.join(built)}" if built else ""
            raise IncompatibleArtifact(f"{self.folder}: variant {name!r} was not built: {variants[name]['reason']}"
                                       + others)
        if not built:
            raise IncompatibleArtifact(f"{self.folder}: the artifact holds no built variant")
        if name is None:
            name = next(iter(built))
        if name not in built:
            raise IncompatibleArtifact(
                f"{self.folder}: no built variant {name!r}; built variants: {', '.join(built)}"
            )
        return {"name": name, **built[name]}

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
