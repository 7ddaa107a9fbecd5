"""bench/attention.py: the attention op alone over long caches, kernel libraries side by side; its JSON and
table, and a missing library refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]
LIBRARY, WHY_NOT = cpu_kernels.library()


def _attention(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "attention.py"), *args], capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(LIBRARY is None, reason=f"Kiln's CPU kernels: {WHY_NOT}")
def test_attention_times_each_library_and_cache(tmp_path):
    out = tmp_path / "attention.json"
    done = _attention(str(LIBRARY), str(LIBRARY), "--cache", "int8", "fp16", "--batch", "2", "--context", "40",
                      "--layers", "2", "--rounds", "1", "--threads", "1", "--output", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert (report["batch"], report["context"], report["layers"]) == (2, 40, 2)
    assert set(report["ms_per_step"]) == {"int8", "fp16"}
    for cell in report["ms_per_step"].values():  # the same library given twice: two entries, each timed
        assert list(cell) == [f"1: {LIBRARY}", f"2: {LIBRARY}"] and all(ms > 0 for ms in cell.values())
    assert f"| int8 | 1: {LIBRARY} |" in done.stdout and f"| fp16 | 2: {LIBRARY} |" in done.stdout
    assert f"| int8 | 1: {LIBRARY} | {report['ms_per_step']['int8'][f'1: {LIBRARY}']:.1f} | 1.00x |" in done.stdout


def test_a_missing_library_is_one_line(tmp_path):
    done = _attention(str(tmp_path / "nowhere.so"), "--output", str(tmp_path / "a.json"))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [f"error: no kernel library at {tmp_path / 'nowhere.so'} "
                                                "(build it: python setup.py build_ext --inplace)"]
    assert not (tmp_path / "a.json").exists()
