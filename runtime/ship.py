"""Shipping an artifact to a production host: pack -> (copy) -> verify -> install -> rollback.

    kiln pack ART -o NAME.kiln [--sign-key K]      one deterministic tar.gz, manifest.json first
    kiln verify NAME.kiln|DIR [--public-key K]     integrity (schema, hashes, external data, signature)
                                                   + a table of which variants fit this host
    kiln install NAME.kiln --into DIR              unpack into DIR/.staging-*, verify, move to
                                                   DIR/versions/<name>-<id>, then switch DIR/current
    kiln rollback --into DIR                       current <-> previous

Nothing from an archive is trusted before it is checked: members are read in order and each must
be a regular file the manifest lists, at a path inside the folder, of the size the manifest gives,
with the manifest's sha256. Links, devices, `..` and absolute paths are refused. ONNX files are
parsed for external-data references (runtime/onnx_refs.py) before ONNX Runtime ever opens them.
A refusal leaves the install folder exactly as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from .artifact import Artifact
from .backends.base import HostFit
from .backends.registry import host_fit as variant_fit
from .errors import ArtifactError, IncompatibleArtifact, KilnError
from .manifest import MANIFEST, Manifest, ManifestError, safe_relative
from .signing import SIGNATURE_FILE, SignatureError, sign, verify_signature

MAX_MANIFEST_BYTES = 64 << 20
# Weights barely compress: an archive that would unpack to far more than this many times its own
# size is refused before anything is written (a zip bomb within the per-file size checks).
MAX_EXPANSION = 8
EXPANSION_ALLOWANCE = 64 << 20
_CHUNK = 1 << 20
STAGING_PREFIX = ".staging-"  # an install's unpacked archive, until it is placed under versions/


class ArchiveError(KilnError):
    """An archive is corrupted, truncated, or holds something it must not."""


# -- pack -----------------------------------------------------------------------------------------

def pack(folder: Path, out: Path, sign_key: Path | None = None) -> Path:
    """One .kiln file (tar + gzip) of the artifact: the same inputs always give the same bytes."""
    artifact = Artifact.open(folder)  # verified: never ship what does not match its own manifest
    manifest = (folder / MANIFEST).read_bytes()
    signature = sign(manifest, sign_key) if sign_key else _existing_signature(folder)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    try:
        with open(partial, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0,
                                                       compresslevel=1) as zipped, \
                tarfile.open(fileobj=zipped, mode="w", format=tarfile.GNU_FORMAT) as tar:
            _add(tar, MANIFEST, len(manifest), io.BytesIO(manifest))
            if signature is not None:
                _add(tar, SIGNATURE_FILE, len(signature), io.BytesIO(signature))
            for relative in sorted(artifact.manifest.files):
                path = folder / relative
                with open(path, "rb") as handle:
                    _add(tar, relative, path.stat().st_size, handle)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def _existing_signature(folder: Path) -> bytes | None:
    path = folder / SIGNATURE_FILE
    return path.read_bytes() if path.is_file() else None


def _add(tar: tarfile.TarFile, name: str, size: int, handle: BinaryIO) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o644, 0, 0, "", ""
    tar.addfile(info, handle)


# -- unpack ---------------------------------------------------------------------------------------

def unpack(archive: Path, dest: Path, public_key: Path | None = None, require_signature: bool = False) -> dict:
    """Extract `archive` into the empty folder `dest`, checking every member as it comes; returns
    the manifest. With a public key (or when a signature is required) the signature, which must follow
    the manifest, is checked before any other file is written. Raises ArchiveError or SignatureError
    naming the first problem."""
    try:
        with tarfile.open(archive, mode="r|*") as tar:
            return _unpack_members(archive, tar, dest, public_key, require_signature)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ArchiveError(f"{archive}: corrupted or truncated archive ({exc or type(exc).__name__})") from None
    except (OSError, ValueError) as exc:  # a file where a folder must go, a name the filesystem refuses
        raise ArchiveError(f"{archive}: cannot be unpacked ({exc})") from None


def _unpack_members(archive: Path, tar: tarfile.TarFile, dest: Path, public_key: Path | None,
                    require_signature: bool) -> Manifest:
    manifest: Manifest | None = None
    raw = b""
    expected: dict[str, dict[str, Any]] = {}
    written: set[str] = set()
    signature_checked = public_key is None and not require_signature
    for member in tar:
        name = member.name
        if member.isdir():
            continue  # folders are made for the files the manifest lists, never from the archive
        problem = safe_relative(name)
        if problem:
            raise ArchiveError(f"{archive}: member {name!r} is {problem}; refused")
        if member.issym() or member.islnk():
            raise ArchiveError(f"{archive}: member {name!r} is a {'symbolic' if member.issym() else 'hard'} link; "
                               "links are refused")
        if member.issparse() or not member.isreg():
            raise ArchiveError(f"{archive}: member {name!r} is not a regular file; refused")
        if manifest is None:
            if name != MANIFEST:
                raise ArchiveError(f"{archive}: the first member must be {MANIFEST}, found {name!r}")
            manifest, expected, raw = _read_manifest(archive, tar, member)
            dest.mkdir(parents=True, exist_ok=True)
            (dest / MANIFEST).write_bytes(raw)
            written.add(MANIFEST)
            continue
        if name in written:
            raise ArchiveError(f"{archive}: member {name!r} appears twice; refused")
        if name == SIGNATURE_FILE:
            if member.size != 64:
                raise ArchiveError(f"{archive}: {SIGNATURE_FILE} is {member.size} bytes, an ed25519 signature is 64")
            signature = tar.extractfile(member).read()
            if public_key is not None:
                verify_signature(raw, signature, public_key)
                signature_checked = True
            (dest / name).write_bytes(signature)
            written.add(name)
            continue
        if not signature_checked:  # before any file of the artifact is written
            if SIGNATURE_FILE in written:
                raise SignatureError("a signature is required: give --public-key to check it")
            raise SignatureError(f"{archive}: not signed (no {SIGNATURE_FILE} right after the manifest), and a "
                                 "signature is required")
        if name not in expected:
            raise ArchiveError(f"{archive}: member {name!r} is not listed in the manifest; refused")
        if member.size != expected[name]["size"]:
            raise ArchiveError(f"{archive}: member {name!r} is {member.size} bytes, the manifest says "
                               f"{expected[name]['size']}; refused")
        _write(archive, tar, member, dest / name, expected[name]["sha256"])
        written.add(name)
    if manifest is None:
        raise ArchiveError(f"{archive}: empty archive (no {MANIFEST})")
    missing = sorted(set(expected) - written)
    if missing:
        raise ArchiveError(f"{archive}: lacks {missing[0]}" + (f" and {len(missing) - 1} more" if missing[1:] else "")
                           + " listed in the manifest (truncated?)")
    return manifest


def _read_manifest(archive: Path, tar: tarfile.TarFile, member: tarfile.TarInfo) -> tuple[Manifest, dict, bytes]:
    if member.size > MAX_MANIFEST_BYTES:
        raise ArchiveError(f"{archive}: {MANIFEST} is {member.size} bytes; refused")
    raw = tar.extractfile(member).read()
    try:
        manifest = Manifest.parse(json.loads(raw.decode("utf-8", errors="strict")), str(archive))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # JSON, and anything the checks missed
        raise ArchiveError(f"{archive}: {MANIFEST} is not a Kiln manifest ({exc})") from None
    except ManifestError as exc:
        raise ArchiveError(f"{exc}; refused") from None
    expected = {k: {"size": v.size, "sha256": v.sha256} for k, v in manifest.files.items()}
    total, size = sum(v["size"] for v in expected.values()), archive.stat().st_size
    # gzip barely shrinks weights; an archive much larger than what it claims to hold is not ours
    limit = total * 1.1 + member.size + (16 << 20)
    if size > limit:
        raise ArchiveError(f"{archive}: {size} bytes, far more than the {int(limit)} its manifest accounts for; "
                           "refused")
    if total > size * MAX_EXPANSION + EXPANSION_ALLOWANCE:
        raise ArchiveError(f"{archive}: would unpack to {total} bytes from {size}; refused as a decompression bomb")
    return manifest, expected, raw


def _write(archive: Path, tar: tarfile.TarFile, member: tarfile.TarInfo, path: Path, sha256: str | None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    source = tar.extractfile(member)
    digest = hashlib.sha256()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(descriptor, "wb") as handle:
        while chunk := source.read(_CHUNK):
            digest.update(chunk)
            handle.write(chunk)
    if sha256 is not None and digest.hexdigest() != sha256:
        raise ArchiveError(f"{archive}: member {member.name!r} fails its sha256 check (corrupted or modified)")


# -- verify ---------------------------------------------------------------------------------------

def check_integrity(folder: Path, public_key: Path | None = None, require_signature: bool = False,
                    rehash: bool = True) -> tuple[Manifest, list[str]]:
    """What the runtime checks before it loads (Artifact.verify, every byte hashed), then the signature.
    Raises on the first problem; returns the manifest and notes on what was checked. `rehash=False` is
    for a folder `unpack` has just written: it hashed every byte as it wrote them."""
    artifact = Artifact.open(folder, verify=False)
    notes = artifact.verify(use_cache=False, rehash=rehash)
    notes.append(_check_signature(folder, public_key, require_signature))
    return artifact.manifest, notes


def _check_signature(folder: Path, public_key: Path | None, require: bool) -> str:
    path = folder / SIGNATURE_FILE
    if public_key is None:
        if require:
            raise SignatureError("a signature is required: give --public-key")
        return "signature present, not checked (no --public-key)" if path.is_file() else "not signed"
    if not path.is_file():
        raise SignatureError(f"{folder}: not signed, and --public-key asks for a signature")
    verify_signature((folder / MANIFEST).read_bytes(), path.read_bytes(), public_key)
    return f"signature verified with {public_key.name}"


def host_fit(manifest: Manifest) -> list[HostFit]:
    """For every variant: what it needs from this host, what the host has, and whether it runs here."""
    return [variant_fit(name, entry, manifest) for name, entry in manifest.variants.items()]


def require_fit(fits: list[HostFit], variant: str | None) -> None:
    """Refuse unless `variant` (or, without one, any variant) runs on this host."""
    wanted = [f for f in fits if f.variant == variant] if variant else fits
    if variant and not wanted:
        names = ", ".join(f.variant for f in fits)
        raise IncompatibleArtifact(f"the artifact has no variant {variant!r}; it has {names}")
    if not any(f.fits for f in wanted):
        reasons = "; ".join(f"{f.variant}: {f.reason}" for f in wanted)
        raise IncompatibleArtifact(f"no variant of the artifact runs on this host ({reasons})")


def verify(path: Path, public_key: Path | None = None,
           require_signature: bool = False) -> tuple[list[str], list[HostFit]]:
    """`kiln verify`: an artifact folder, or an archive unpacked (checked) into a temporary folder;
    returns the notes of what was checked and what each variant needs from this host."""
    if path.is_dir():
        manifest, notes = check_integrity(path, public_key, require_signature)
        return notes, host_fit(manifest)
    if not path.is_file():
        raise ArtifactError(f"{path}: no such artifact folder or .kiln file")
    with tempfile.TemporaryDirectory(prefix="kiln-verify-") as temporary:
        folder = Path(temporary) / "artifact"
        unpack(path, folder, public_key, require_signature)
        manifest, notes = check_integrity(folder, public_key, require_signature, rehash=False)
    return notes, host_fit(manifest)


# -- install and rollback -------------------------------------------------------------------------

def install(archive: Path, into: Path, public_key: Path | None = None, require_signature: bool = False,
            variant: str | None = None) -> Path:
    """Unpack, verify and switch `into`/current to the new version; `into`/previous keeps the old one."""
    if not archive.is_file():
        raise ArtifactError(f"{archive}: no such .kiln file")
    created = not into.exists()
    into.mkdir(parents=True, exist_ok=True)
    into = Path(os.path.realpath(into))  # links are made relative to the real folder
    try:
        with _locked(into):
            return _install_locked(archive, into, public_key, require_signature, variant)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                into.rmdir()  # only if still empty: another install may have filled it meanwhile
        raise


def _install_locked(archive: Path, into: Path, public_key: Path | None, require_signature: bool,
                    variant: str | None) -> Path:
    for name in ("current", "previous"):
        if os.path.lexists(into / name) and not os.path.islink(into / name):
            raise ArtifactError(f"{into}: {name} exists and is not a link Kiln made; move it away first")
    if os.path.islink(into / "versions"):
        raise ArtifactError(f"{into}: versions is a link; Kiln keeps its versions in a real folder")
    _remove_leftovers(into)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=into))
    try:
        manifest = unpack(archive, staging / "artifact", public_key, require_signature)
        check_integrity(staging / "artifact", public_key, require_signature, rehash=False)
        require_fit(host_fit(manifest), variant)
        identity = hashlib.sha256((staging / "artifact" / MANIFEST).read_bytes()).hexdigest()[:12]
        version = into / "versions" / f"{manifest.name}-{identity}"
        version.parent.mkdir(exist_ok=True)
        _place(staging, version)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    current = _link_target(into / "current")
    if current != version:  # previous first: killed between the two, current still works and keeps its place
        if current is not None:
            _switch(into, "previous", current)
        _switch(into, "current", version)
    return version


def _remove_leftovers(into: Path) -> None:
    """What installs killed midway left (under the lock, no other install is running): their staging
    folders and the links they had not yet renamed into place. Their placed versions stay."""
    for path in into.iterdir():
        if path.name.startswith(STAGING_PREFIX) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith((".current.", ".previous.")) and path.is_symlink():
            path.unlink(missing_ok=True)


def _place(staging: Path, version: Path) -> None:
    """Move the verified artifact to `version`. A folder already there (the same manifest, installed
    before) is kept only if it still passes every check; otherwise the fresh copy replaces it."""
    if version.exists():
        try:
            check_integrity(version)
            return
        except KilnError:
            aside = staging / "replaced"
            os.rename(version, aside)
    os.rename(staging / "artifact", version)


def rollback(into: Path) -> Path:
    """Switch `into`/current back to `into`/previous (and previous to what was current)."""
    into = Path(os.path.realpath(into))
    with _locked(into):
        current, previous = _link_target(into / "current"), _link_target(into / "previous")
        if previous is None or not previous.is_dir():
            raise ArtifactError(f"{into}: no previous version to roll back to")
        _switch(into, "current", previous)
        if current is not None:
            _switch(into, "previous", current)
        return previous


def _link_target(link: Path) -> Path | None:
    return Path(os.path.normpath(link.parent / os.readlink(link))) if link.is_symlink() else None


def _switch(into: Path, name: str, target: Path) -> None:
    """Point into/name at target in one step: a new link renamed over the old (rename is atomic)."""
    temporary = into / f".{name}.{os.getpid()}"
    temporary.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, into), temporary)
    os.replace(temporary, into / name)


@contextlib.contextmanager
def _locked(into: Path) -> Iterator[None]:
    """One install or rollback at a time per folder; the folder itself is the lock (no lock file)."""
    if not into.is_dir():
        raise ArtifactError(f"{into}: no such install folder")
    descriptor = os.open(into, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)
