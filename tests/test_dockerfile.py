"""The Dockerfile cannot be built here (no Docker engine): it is linted with hadolint, and its slim
runtime stage is checked to install only runtime/ and dependencies without torch."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = {"torch", "transformers", "onnxscript", "accelerate", "gguf", "onnx", "safetensors"}


def _stages() -> dict[str, list[str]]:
    stages, current = {}, None
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.I)
        if match:
            current = match.group(1)
            stages[current] = []
        elif current and line.strip() and not line.lstrip().startswith("#"):
            stages[current].append(line.strip())
    return stages


def _requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0].lower()


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_runtime_image_has_no_torch():
    stages = _stages()
    assert set(stages) == {"build", "runtime"}
    runtime = "\n".join(stages["runtime"])
    copied = re.findall(r"^COPY\s+(.+?)\s+\S+$", runtime, re.M)
    assert copied == ["pyproject.toml setup.py README.md", "runtime/"], copied  # no compiler/, no recipes
    extras = re.search(r'pip install "\.\[([a-z,]+)\]"', runtime).group(1).split(",")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    names = {_requirement_name(r) for r in requirements}
    assert not names & HEAVY, names & HEAVY
    assert {"onnxruntime-gpu", "tensorrt", "numpy", "tokenizers"} <= names
    build = "\n".join(stages["build"])
    assert "compiler/" in build and '".[compiler,gpu,tensorrt]"' in build
