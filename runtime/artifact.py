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

    def verify(self) -> None:
        for relative, entry in self.manifest["files"].items():
            path = self.folder / relative
            if not path.is_file():
                raise ArtifactError(f"{self.folder}: file {relative} listed in the manifest is missing")
            if path.stat().st_size != entry["size"]:
                raise ArtifactError(f"{self.folder}: file {relative} has the wrong size (modified after compile)")
            if sha256_file(path) != entry["sha256"]:
                raise ArtifactError(f"{self.folder}: file {relative} fails its sha256 check (modified after compile)")

    def variant(self, name: str | None = None) -> dict[str, Any]:
        """A built variant's manifest entry; without a name, the first one built. A variant that missed
        its accuracy gates (kept by compile-model --keep-failed) loads only when named."""
        variants = self.manifest["variants"]
        if name is not None and variants.get(name, {}).get("status") == "failed":
            return {"name": name, **variants[name]}
        built = {k: v for k, v in variants.items() if v.get("status") == "built"}
        if name is not None and variants.get(name, {}).get("status") == "skipped":
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
