"""The Dockerfile, read: linted with hadolint, and its runtime stages checked to install only runtime/
and dependencies without torch. tests/test_docker.py builds and runs the CPU images; the GPU ones
are checked here alone (their bases are on NVIDIA's registry)."""

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


def _extras(stage: str) -> list[str]:
    """The extras of the first `pip install ...[extras]"` in a stage (a wheel's path or ".")."""
    return re.search(r'pip install "[^"]*\[([a-z,]+)\]"', stage).group(1).split(",")


def _requirements(extras: list[str]) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]
    return {_requirement_name(r) for r in requirements}


def test_runtime_images_have_no_torch():
    stages = {name: "\n".join(lines) for name, lines in _stages().items()}
    assert set(stages) == {"python-base", "wheels", "runtime-venv", "runtime-cpu", "build-venv", "build-cpu",
                           "build-gpu", "runtime-gpu"}
    # The CPU runtime: a wheel built before compiler/ is copied in, its cpu extra, and only the venv
    # carried into the image (no compiler, no wheelhouse), run as a user that is not root.
    wheels = stages["wheels"]
    assert wheels.index("/wheels/kiln-runtime") < wheels.index("COPY compiler/ compiler/")
    names = _requirements(_extras(stages["runtime-venv"]))
    assert "kiln-runtime/" in stages["runtime-venv"] and not names & HEAVY, names & HEAVY
    assert {"onnxruntime", "numpy", "tokenizers"} <= names
    runtime = stages["runtime-cpu"]
    assert re.findall(r"^COPY\s+(.+)$", runtime, re.M) == ["--from=runtime-venv /opt/venv /opt/venv"]
    assert "USER 10001" in runtime and "HEALTHCHECK" in runtime and 'ENTRYPOINT ["kiln"]' in runtime
    assert _requirements(_extras(stages["build-venv"])) >= {"torch", "onnxruntime"}
    # The GPU runtime, as before: runtime/ alone, the gpu and tensorrt extras.
    gpu = stages["runtime-gpu"]
    copied = re.findall(r"^COPY\s+(.+?)\s+\S+$", gpu, re.M)
    assert copied == ["pyproject.toml setup.py README.md", "runtime/"], copied  # no compiler/, no recipes
    names = _requirements(_extras(gpu))
    assert not names & HEAVY, names & HEAVY
    assert {"onnxruntime-gpu", "tensorrt", "numpy", "tokenizers"} <= names
    assert "compiler/" in stages["build-gpu"] and '".[compiler,gpu,tensorrt]"' in stages["build-gpu"]


def test_the_kubernetes_example_is_valid_yaml_with_probes_and_a_drain():
    """docs/docker.md's Deployment parses, probes /health, and gives the preStop sleep and the drain the
    grace period they need."""
    import yaml

    text = (ROOT / "docs" / "docker.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    assert blocks, "docs/docker.md has no yaml block"
    documents = [d for block in blocks for d in yaml.safe_load_all(block)]
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    service = next(d for d in documents if d["kind"] == "Service")
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["selector"]["matchLabels"] == deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    container = pod["containers"][0]
    assert container["args"][0] == "serve" and container["ports"][0]["containerPort"] == 8000
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    drain = float(container["args"][container["args"].index("--drain-timeout") + 1])
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= drain + pre_stop
    assert pod["securityContext"]["runAsUser"] == 10001
    assert container["volumeMounts"][0]["readOnly"] is True
