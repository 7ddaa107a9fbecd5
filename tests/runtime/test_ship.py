"""kiln pack / verify / install / rollback / keygen for real: archives on disk, crafted bad archives,
signatures, links switched in the install folder, generation from the installed artifact."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

import runtime.artifact
from runtime.artifact import Artifact, sha256_file
from runtime.errors import ArtifactError
from runtime.generator import Generator
from runtime.kiln_cli import kiln
from runtime.sampling import SamplingParams
from runtime.ship import install, pack, rollback

PARAMS = SamplingParams(max_new_tokens=8)


def cli(*args) -> object:
    return CliRunner().invoke(kiln, [str(a) for a in args])


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("keys")
    assert cli("keygen", folder / "ci").exit_code == 0
    assert oct((folder / "ci.key").stat().st_mode & 0o777) == "0o600"
    assert cli("keygen", folder / "other").exit_code == 0
    return folder / "ci", folder / "other"


@pytest.fixture(scope="module")
def packed(tiny_artifacts, keys, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "llama.kiln"
    result = cli("pack", tiny_artifacts["llama"], "-o", out, "--sign-key", keys[0].with_suffix(".key"))
    assert result.exit_code == 0, result.output
    return out


def snapshot(folder: Path) -> dict:
    """Every path under folder with its link target or content hash: 'nothing changed' is equality."""
    if not folder.exists():
        return {}
    state = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            key = str(path.relative_to(folder))
            state[key] = os.readlink(path) if path.is_symlink() else (sha256_file(path) if path.is_file() else "dir")
    return state


def test_pack_is_deterministic_and_round_trips_to_generation(tiny_artifacts, packed, keys, tmp_path):
    again = tmp_path / "again.kiln"
    assert cli("pack", tiny_artifacts["llama"], "-o", again, "--sign-key", keys[0].with_suffix(".key")).exit_code == 0
    assert again.read_bytes() == packed.read_bytes()
    with tarfile.open(packed) as tar:
        names = tar.getnames()
    assert names[:2] == ["manifest.json", "signature.ed25519"]
    result = cli("install", packed, "--into", tmp_path / "srv", "--public-key", keys[0].with_suffix(".pub"),
                 "--require-signature")
    assert result.exit_code == 0, result.output
    current = tmp_path / "srv" / "current"
    assert current.is_symlink() and not (tmp_path / "srv" / "previous").exists()
    prompts = ["The quick brown", "Paris is"]
    installed = [r.token_ids for r in Generator.load(current).generate(prompts, PARAMS)]
    original = [r.token_ids for r in Generator.load(tiny_artifacts["llama"]).generate(prompts, PARAMS)]
    assert installed == original
    run = cli("run", current, "--prompt", "The quick brown", "--max-new-tokens", "4")
    assert run.exit_code == 0, run.output


def test_verify_checks_signature_and_prints_what_fits(packed, keys):
    good = cli("verify", packed, "--public-key", keys[0].with_suffix(".pub"))
    assert good.exit_code == 0, good.output
    assert "signature verified with ci.pub" in good.output
    assert "cpu-fp32" in good.output and "yes" in good.output
    wrong = cli("verify", packed, "--public-key", keys[1].with_suffix(".pub"))
    assert wrong.exit_code == 1
    assert "signature does not match the public key" in wrong.stderr
    assert cli("verify", packed, "--require-signature").exit_code == 1  # required, but no key to check it with
    assert cli("verify", packed.with_name("missing.kiln")).exit_code == 2


def test_modified_file_and_re_hashed_manifest_are_both_refused(tiny_artifacts, packed, keys, tmp_path):
    folder = tmp_path / "art"
    shutil.copytree(tiny_artifacts["llama"], folder)
    (folder / "tokenizer" / "tokenizer_config.json").write_text("{}")
    result = cli("verify", folder)
    assert result.exit_code == 1 and "tokenizer_config.json has the wrong size (modified after compile)" in result.stderr

    # re-hash the manifest to match: the hashes pass, the signature (over the old manifest) does not
    manifest = json.loads((folder / "manifest.json").read_text())
    path = folder / "tokenizer" / "tokenizer_config.json"
    manifest["files"]["tokenizer/tokenizer_config.json"] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    signature = tmp_path / "unpacked"
    with tarfile.open(packed) as tar:
        tar.extract("signature.ed25519", signature, filter="data")
    shutil.copy(signature / "signature.ed25519", folder / "signature.ed25519")
    assert cli("verify", folder).exit_code == 0  # consistent, and unsigned checks were not asked for
    tampered = cli("verify", folder, "--public-key", keys[0].with_suffix(".pub"))
    assert tampered.exit_code == 1 and "signature does not match" in tampered.stderr


def test_rollback_switches_back_and_forth(tiny_artifacts, tmp_path):
    first, second = tmp_path / "llama.kiln", tmp_path / "qwen2.kiln"
    pack(tiny_artifacts["llama"], first)
    pack(tiny_artifacts["qwen2"], second)
    srv = tmp_path / "srv"
    v1 = install(first, srv)
    v2 = install(second, srv)
    assert (srv / "current").resolve() == v2 and (srv / "previous").resolve() == v1
    result = cli("rollback", "--into", srv)
    assert result.exit_code == 0, result.output
    assert (srv / "current").resolve() == v1 and (srv / "previous").resolve() == v2
    assert Artifact.open(srv / "current").manifest.name == "tiny-llama"
    assert rollback(srv) == v2 and (srv / "current").resolve() == v2
    assert install(second, srv) == v2  # the same archive again: nothing to switch
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="no previous version"):
        rollback(tmp_path / "empty")


# -- crafted archives: every one refused, the install folder unchanged ---------------------------

def _members(packed: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(packed) as tar:
        return [(m, tar.extractfile(m).read()) for m in tar.getmembers()]


def _write(path: Path, members: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as zipped, \
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, b""


def _craft(case: str, packed: Path, tmp_path: Path) -> Path:
    members = _members(packed)
    manifest = json.loads(members[0][1])
    listed = next(n for n in manifest["files"] if n.startswith("tokenizer/"))
    out = tmp_path / f"{case.replace(' ', '-')}.kiln"
    if case == "corrupted":
        data = bytearray(packed.read_bytes())
        data[len(data) // 2] ^= 0xFF
        out.write_bytes(bytes(data))
        return out
    if case == "truncated":
        out.write_bytes(packed.read_bytes()[: packed.stat().st_size // 2])
        return out
    extra = {
        "parent escape": [_file("../x", b"x")],
        "nested escape": [_file("sub/../../x", b"x")],
        "absolute path": [_file("/tmp/kiln-x", b"x")],
        "symlink": [_link("tokenizer/evil", "/etc/passwd", tarfile.SYMTYPE)],
        "hardlink": [_link("tokenizer/evil", "/etc/passwd", tarfile.LNKTYPE)],
        "unlisted file": [_file("tokenizer/extra.json", b"{}")],
        "oversized member": [],
        "far larger": [_file("padding.bin", os.urandom(24 << 20))],
        "missing file": [],
        "manifest not first": [],
    }[case]
    if case == "oversized member":
        members = [(_file(listed, data + b" " * 4096) if m.name == listed else (m, data)) for m, data in members]
    if case == "missing file":
        members = [(m, d) for m, d in members if m.name != listed]
    if case == "manifest not first":
        members = members[2:] + members[:2]
    return _write(out, members[:2] + extra + members[2:])


CASES = {
    "corrupted": "corrupted", "truncated": "corrupted or truncated archive",
    "parent escape": "climbs out of its folder", "nested escape": "climbs out of its folder",
    "absolute path": "an absolute path", "symlink": "symbolic link; links are refused",
    "hardlink": "hard link; links are refused", "unlisted file": "not listed in the manifest",
    "oversized member": "the manifest says", "far larger": "far more than",
    "missing file": "listed in the manifest (truncated?)", "manifest not first": "the first member must be",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_archives_are_refused_and_change_nothing(case, packed, tiny_artifacts, tmp_path):
    srv = tmp_path / "srv"
    install(packed, srv)
    before = snapshot(srv)
    bad = _craft(case, packed, tmp_path)
    result = cli("install", bad, "--into", srv)
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith("kiln install: error: ") and CASES[case] in line, line
    assert snapshot(srv) == before
    assert not (tmp_path / "kiln-x").exists() and not Path("/tmp/kiln-x").exists()
    fresh = tmp_path / "fresh"
    assert cli("install", bad, "--into", fresh).exit_code == 1 and not fresh.exists()


def _with_external_data(tiny_artifacts: Path, tmp_path: Path, edit) -> Path:
    """A copy of the artifact whose graph keeps its weights in model.onnx.data (listed, hashed), with
    `edit` applied to the external-data entries, and the manifest re-hashed to match."""
    folder = tmp_path / "ext"
    shutil.copytree(tiny_artifacts, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    variant = folder / "variants" / "cpu-fp32"
    model = onnx.load(str(variant / "model.onnx"))
    onnx.save_model(model, str(variant / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    model = onnx.load(str(variant / "model.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        entries = {e.key: e for e in tensor.external_data}
        if entries:
            edit(entries)
    onnx.save(model, str(variant / "model.onnx"))
    for name in ("model.onnx", "model.onnx.data"):
        path = variant / name
        manifest["files"][f"variants/cpu-fp32/{name}"] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


@pytest.mark.parametrize("case, edit, message", [
    ("escape", lambda e: setattr(e["location"], "value", "../../manifest.json"), "climbs out of its folder"),
    ("absolute", lambda e: setattr(e["location"], "value", "/etc/passwd"), "an absolute path"),
    ("unlisted", lambda e: setattr(e["location"], "value", "weights.bin"), "which the manifest does not list"),
    ("past the end", lambda e: setattr(e["length"], "value", str(10 ** 9)), "past its"),
])
def test_external_data_references_are_checked_before_loading(case, edit, message, tiny_artifacts, tmp_path,
                                                             monkeypatch):
    good = _with_external_data(tiny_artifacts["llama"], tmp_path / "good", lambda e: None)
    assert cli("verify", good).exit_code == 0
    bad = _with_external_data(tiny_artifacts["llama"], tmp_path / "bad", edit)
    result = cli("verify", bad)
    assert result.exit_code == 1 and message in result.stderr, result.output
    with pytest.raises(ArtifactError, match=message):  # loading and packing make the same check as verify
        Artifact.open(bad)
    archive = tmp_path / "bad.kiln"
    with pytest.raises(ArtifactError, match=message):
        pack(bad, archive)
    with monkeypatch.context() as unchecked:  # an archive made by a tool that checks nothing: install refuses it
        unchecked.setattr(Artifact, "verify", lambda self, *args, **kwargs: [])
        pack(bad, archive)
    assert cli("install", archive, "--into", tmp_path / "srv").exit_code == 1


def test_hash_cache_skips_unchanged_files_and_catches_changed_ones(tiny_artifacts, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "art"
    shutil.copytree(tiny_artifacts["gpt2"], folder)
    Artifact.open(folder)  # hashes every file and remembers them

    def no_hashing(*args, **kwargs):
        raise AssertionError("hashed a file whose size, mtime and inode are unchanged")

    monkeypatch.setattr(runtime.artifact, "sha256_file", no_hashing)
    Artifact.open(folder)
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = folder / "tokenizer" / "generation_config.json"
    config.write_text(config.read_text().replace("0", "1", 1))
    with pytest.raises(ArtifactError, match="generation_config.json (has the wrong size|fails its sha256)"):
        Artifact.open(folder)
    # The trusted-host escape (run-model --no-verify) loads the changed copy as it is, and runs it.
    trusted = Generator.load(folder, verify=False)
    assert trusted.artifact.generation_config == json.loads(config.read_text()) != \
        Artifact.open(tiny_artifacts["gpt2"]).generation_config
    assert trusted.generate(["Hello"], SamplingParams(max_new_tokens=2))[0].error is None


# -- found in review: each was a way through, now refused ----------------------------------------

def _with_manifest(packed: Path, out: Path, edit, extra: list | None = None, drop_signature: bool = True) -> Path:
    members = _members(packed)
    manifest = json.loads(members[0][1])
    edit(manifest)
    raw = json.dumps(manifest).encode()
    info, _ = members[0]
    rest = [(m, d) for m, d in members[1:] if not (drop_signature and m.name == "signature.ed25519")]
    return _write(out, [_file(info.name, raw)] + (extra or []) + rest)


def _zeros_entry(size: int) -> dict:
    import hashlib

    digest = hashlib.sha256()
    chunk = bytes(1 << 20)
    for _ in range(size >> 20):
        digest.update(chunk)
    return {"sha256": digest.hexdigest(), "size": size}


@pytest.mark.parametrize("case, message", [
    ("name escape", "is not [a-z0-9][a-z0-9._-]*"),
    ("file and folder", "both as a file and as a folder"),
    ("model outside", "which the manifest does not list"),
    ("bomb", "refused as a decompression bomb"),
    ("sparse", "not a regular file"),
    ("unsigned", "not signed"),
])
def test_review_findings_are_refused(case, message, packed, keys, tmp_path):
    srv = tmp_path / "srv"
    install(packed, srv)
    before = snapshot(srv)
    out = tmp_path / "bad.kiln"
    if case == "name escape":
        _with_manifest(packed, out, lambda m: m.update(name="../../escaped"))
    elif case == "file and folder":
        _with_manifest(packed, out, lambda m: m["files"].update(tokenizer={"sha256": "0" * 64, "size": 0}))
    elif case == "model outside":
        _with_manifest(packed, out, lambda m: m["variants"]["cpu-fp32"].update(model="/tmp/unverified.onnx"))
    elif case == "bomb":
        big = 100 << 20
        _with_manifest(packed, out, lambda m: m["files"].update({"big.bin": _zeros_entry(big)}),
                       extra=[_file("big.bin", bytes(big))])
    elif case == "sparse":
        import subprocess

        folder = tmp_path / "sparse"
        folder.mkdir()
        members = _members(packed)
        manifest = json.loads(members[0][1])
        manifest["files"]["big.bin"] = _zeros_entry(16 << 20)  # under the bomb allowance
        (folder / "manifest.json").write_text(json.dumps(manifest))
        with open(folder / "big.bin", "wb") as handle:
            handle.truncate(16 << 20)
        subprocess.run(["tar", "--sparse", "--format=gnu", "-czf", str(out), "-C", str(folder), "manifest.json",
                        "big.bin"], check=True)
    elif case == "unsigned":
        _with_manifest(packed, out, lambda m: None)
    args = ["--public-key", keys[0].with_suffix(".pub")] if case == "unsigned" else []
    result = cli("install", out, "--into", srv, *args)
    assert result.exit_code == 1, result.output
    line = result.stderr.strip()
    assert "\n" not in line and message in line, line
    assert snapshot(srv) == before
    assert not (tmp_path / "escaped").exists() and not list(tmp_path.glob("escaped*"))


def test_install_folder_edge_cases(packed, tiny_artifacts, tmp_path):
    other = tmp_path / "qwen2.kiln"
    pack(tiny_artifacts["qwen2"], other)
    # reached through a symlink: links stay valid and rollback works
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "via").symlink_to(real)
    v1, v2 = install(packed, tmp_path / "via"), install(other, tmp_path / "via")
    assert (real / "current").resolve() == v2.resolve() and (real / "previous").resolve() == v1.resolve()
    assert rollback(tmp_path / "via").resolve() == v1.resolve() and (real / "current").resolve() == v1.resolve()
    # a version folder tampered with after install is replaced, not reused, when installed again
    (v2 / "planted.py").write_text("print('hi')")
    assert install(other, real) == v2 and not (v2 / "planted.py").exists()
    # a `current` that is not Kiln's link is never overwritten
    odd = tmp_path / "odd"
    (odd / "current").mkdir(parents=True)
    before = snapshot(odd)
    result = cli("install", packed, "--into", odd)
    assert result.exit_code == 1 and "current exists and is not a link Kiln made" in result.stderr
    assert snapshot(odd) == before


def test_hash_cache_catches_a_restored_mtime(tiny_artifacts, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    folder = tmp_path / "art"
    shutil.copytree(tiny_artifacts["gpt2"], folder)
    Artifact.open(folder)
    path = folder / "variants" / "cpu-fp32" / "model.onnx"
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, mtime and inode; ctime moved
    with pytest.raises(ArtifactError, match="fails its sha256 check"):
        Artifact.open(folder)


def test_external_data_without_length_is_refused(tiny_artifacts, tmp_path):
    def drop_length(entries):
        entries["offset"].value = "0"
        entries["length"].value = ""

    bad = _with_external_data(tiny_artifacts["llama"], tmp_path, drop_length)
    result = cli("verify", bad)
    assert result.exit_code == 1 and "plain numeric offset and length" in result.stderr


# -- installs killed midway, and two at once ------------------------------------------------------

def _install_process(archive: Path, into: Path):
    import subprocess
    import sys

    return subprocess.Popen([sys.executable, "-m", "runtime.kiln_cli", "install", str(archive), "--into", str(into)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _serves(into: Path, names: set[str]) -> str:
    """The name of the artifact `current` points at, checked to load and verify whole."""
    opened = Artifact.open(into / "current")
    assert opened.manifest.name in names
    return opened.manifest.name


def test_an_install_killed_at_any_point_leaves_a_working_current(packed, tiny_artifacts, tmp_path):
    """SIGKILL while the archive unpacks into its staging folder, while it is verified, and at delays
    spread over the whole run: `current` always opens and verifies (the old version or the new), and
    the next install cleans what the killed one left and completes."""
    import signal
    import time

    other = tmp_path / "qwen2.kiln"
    pack(tiny_artifacts["qwen2"], other)
    srv = tmp_path / "srv"
    install(packed, srv)
    names = {"tiny-llama", "tiny-qwen2"}
    started = time.perf_counter()
    whole = _install_process(other, tmp_path / "timing")
    assert whole.wait(timeout=120) == 0, whole.stderr.read()
    duration = time.perf_counter() - started
    killed_at = []
    points = ["staging"] + [duration * f for f in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0)]
    for point in points:
        archive = other if len(killed_at) % 2 == 0 else packed  # each run switches versions, when it gets there
        process, began = _install_process(archive, srv), time.perf_counter()
        while process.poll() is None:
            staged = any(p.name.startswith(".staging-") for p in srv.iterdir())
            if (point == "staging" and staged) or (point != "staging" and time.perf_counter() - began >= point):
                process.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        code = process.wait(timeout=120)
        killed_at.append(code)
        _serves(srv, names)
        assert (srv / "current").is_symlink()
    assert -signal.SIGKILL in killed_at  # some runs were killed midway (the rest finished before their point)
    assert install(other, srv).name.startswith("tiny-qwen2")
    assert not [p.name for p in srv.iterdir() if p.name.startswith((".staging-", ".current.", ".previous."))]
    assert _serves(srv, names) == "tiny-qwen2"


def test_two_installs_at_once_are_serialized(packed, tiny_artifacts, tmp_path):
    other = tmp_path / "qwen2.kiln"
    pack(tiny_artifacts["qwen2"], other)
    srv = tmp_path / "srv"
    first, second = _install_process(packed, srv), _install_process(other, srv)
    assert first.wait(timeout=120) == 0, first.stderr.read()
    assert second.wait(timeout=120) == 0, second.stderr.read()
    current, previous = (srv / "current").resolve(), (srv / "previous").resolve()
    assert {current.name.split("-")[1], previous.name.split("-")[1]} == {"llama", "qwen2"}
    assert Artifact.open(current) and Artifact.open(previous)
    assert len(list((srv / "versions").iterdir())) == 2
    assert not [p.name for p in srv.iterdir() if p.name.startswith(".staging-")]
