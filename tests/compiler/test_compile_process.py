"""Load, export and the eager reference run in a process of their own (compiler/pipeline.py
in_child_process): the compile's own process never imports torch, and what the child raises or how
it dies reaches the user as it would have in one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from compiler.errors import CompileProcessError, RecipeError
from compiler.pipeline import in_child_process
from tests.conftest import FP32_VARIANT, write_recipe


def _doubled(value: int) -> dict:
    return {"doubled": 2 * value, "pid": os.getpid()}


def _bad_recipe() -> None:
    raise RecipeError("export.max_context: 9999 exceeds the model's max_position_embeddings 128")


def _bug() -> None:
    raise ValueError("a bug in the child")


def _killed() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class Unrebuildable(Exception):
    def __init__(self, part: str, rest: str) -> None:  # pickle rebuilds it from one argument: it cannot
        super().__init__(part + rest)


def _unrebuildable() -> None:
    raise Unrebuildable("two ", "arguments")


def _waits(pid_file: str) -> None:
    with open(pid_file, "w") as handle:
        handle.write(str(os.getpid()))
    time.sleep(120)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return any(line.split()[1] == "Z" for line in status if line.startswith("State:"))
    except FileNotFoundError:
        return True


def test_a_child_process_brings_back_its_result_its_errors_and_its_death():
    result = in_child_process(_doubled, 21)
    assert result["doubled"] == 42 and result["pid"] != os.getpid()
    with pytest.raises(RecipeError, match="max_position_embeddings 128"):  # the same type, the same one line
        in_child_process(_bad_recipe)
    with pytest.raises(ValueError, match="a bug in the child") as raised:
        in_child_process(_bug)
    assert any("Traceback" in note and "_bug" in note for note in raised.value.__notes__)  # for --debug
    with pytest.raises(CompileProcessError, match=r"exit code -9 \(killed: most likely out of memory\)"):
        in_child_process(_killed)
    with pytest.raises(CompileProcessError, match="could not hand back Unrebuildable: two arguments") as raised:
        in_child_process(_unrebuildable)
    assert any("_unrebuildable" in note for note in raised.value.__notes__)


def test_the_child_dies_with_its_parent(tmp_path):
    """A compile killed outright (SIGKILL, the OOM killer) takes its load / export / reference process
    with it: no orphan goes on exporting into a staging folder nobody owns."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", "from compiler.pipeline import in_child_process\n"
                               "from tests.compiler.test_compile_process import _waits\n"
                               f"in_child_process(_waits, {str(pid_file)!r})\n"])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    child = int(pid_file.read_text())
    assert not _gone(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child)


def test_the_compile_process_never_imports_torch(tiny_checkpoints, tmp_path):
    """A whole compile in a fresh interpreter: torch and transformers are imported by the child only,
    and the stage log still has every stage's time and peak, the child's peaks counted with what the
    parent held beside them."""
    recipe = write_recipe(tmp_path / "tiny.yaml", tiny_checkpoints["llama"], name="tiny", variants=FP32_VARIANT)
    script = (
        "import json, sys\n"
        "from rich.console import Console\n"
        "from compiler.pipeline import compile_recipe\n"
        "from compiler.progress import StageLog\n"
        "log = StageLog(Console(quiet=True))\n"
        f"folder = compile_recipe({str(recipe)!r}, {str(tmp_path / 'out')!r}, log=log)\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'transformers': 'transformers' in sys.modules,\n"
        "                  'seconds': log.seconds, 'peaks': log.peak_rss, 'folder': str(folder)}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr  # no semaphore left to the resource tracker
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert not facts["torch"] and not facts["transformers"]
    stages = ["load", "reference", "export", "validate export", "variant cpu-fp32", "package"]
    assert list(facts["seconds"]) == stages and all(facts["peaks"][s] > 0 for s in stages)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert list(manifest["compile"]["stage_peak_rss_mib"]) == stages[:-1]  # written during package
    assert manifest["variants"]["cpu-fp32"]["accuracy"]["top1_agreement"] == 1.0
