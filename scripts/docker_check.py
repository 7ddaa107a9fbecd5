"""The CPU images built and run for real (scripts/docker-check runs this; so does the test suite).

1. A Docker engine: the one that answers, else Debian's docker.io (installed if missing) started with
   its own data root and socket under KILN_DOCKER_ROOT (/var/tmp/kiln-docker), and stopped at the end.
   Images and the base stay there between runs, so a second run builds from cache.
2. scripts/docker-build: the base (pulled, or made with debootstrap), the wheelhouse, both images.
3. kiln-build-cpu compiles a tiny random-weight Llama's recipe into a mounted folder.
4. kiln-runtime-cpu verifies it (artifact mounted read-only), then serves it with the port published
   on 127.0.0.1 only. The official openai client's chat and streamed completions must answer with the
   tokens the runtime outside Docker gives; the health check must turn healthy; the process must not
   be root; the image must hold no torch and no compiler; `docker stop` must drain a running stream
   to its end and the container exit 0.

Exit 0 when everything holds, 1 with one line naming what failed, 3 with the reason when it cannot
run here (not root and no engine answers, no apt-get).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RUNTIME, BUILD = "kiln-runtime-cpu", "kiln-build-cpu"
MAX_RUNTIME_MB = 400
CONTAINER = "kiln-docker-check"


class CannotRun(Exception):
    pass


class Failed(Exception):
    pass


def say(line: str) -> None:
    print(f"docker-check: {line}", flush=True)


def docker(*args: str, check: bool = True, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and done.returncode != 0:
        raise Failed(f"docker {' '.join(args[:3])} ... exited {done.returncode}: "
                     f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done


def engine_answers() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True, timeout=60).returncode == 0


def start_engine(root: Path) -> subprocess.Popen | None:
    """The engine to use: the one that answers (None: not ours to stop), else a dockerd of our own."""
    if engine_answers():
        return None
    if os.geteuid() != 0:
        raise CannotRun("no Docker engine answers and starting one needs root")
    if shutil.which("dockerd") is None:
        if shutil.which("apt-get") is None:
            raise CannotRun("no Docker engine, and no apt-get to install Debian's docker.io")
        say("installing Debian's docker.io")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a dpkg cut short breaks later installs
        try:
            subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, env=env)
            subprocess.run(["apt-get", "install", "-y", "-qq", "docker.io", "debootstrap"], check=True,
                           capture_output=True, env=env)
        finally:
            signal.signal(signal.SIGTERM, previous)
    root.mkdir(parents=True, exist_ok=True)
    socket = root / "docker.sock"
    os.environ["DOCKER_HOST"] = f"unix://{socket}"
    if engine_answers():  # one of ours left running by a run that was killed: use it, stop it after
        pid = int((root / "docker.pid").read_text())
        return _Adopted(pid)
    log = open(root / "dockerd.log", "ab")
    daemon = subprocess.Popen(["dockerd", "--data-root", str(root / "data"), "--exec-root", str(root / "exec"),
                               "--host", f"unix://{socket}", "--pidfile", str(root / "docker.pid")],
                              stdout=log, stderr=log)
    try:
        deadline = time.time() + 60
        while not engine_answers():
            if daemon.poll() is not None or time.time() > deadline:
                raise Failed(f"dockerd did not start; its log: {root / 'dockerd.log'}")
            time.sleep(0.5)
    except BaseException:  # SIGTERM meanwhile too: the daemon is not left behind
        daemon.terminate()
        daemon.wait(60)
        raise
    say(f"started dockerd (data root {root / 'data'}, socket {socket})")
    return daemon


class _Adopted:
    def __init__(self, pid: int) -> None:
        self.pid = pid

    def terminate(self) -> None:
        os.kill(self.pid, 15)

    def wait(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline and Path(f"/proc/{self.pid}").exists():
            time.sleep(0.2)


def tiny_project(folder: Path) -> Path:
    """A tiny random-weight Llama checkpoint with a tokenizer and chat template, and its recipe."""
    from tests.conftest import long_context_llama

    long_context_llama(folder / "checkpoint")
    recipe = folder / "tiny.yaml"
    recipe.write_text('name: tiny-docker\nmodel: {source: "checkpoint"}\n'
                      "export: {opset: 18, max_context: 2048, logits: last}\n"
                      "variants:\n  - {name: cpu-fp32, target: onnxruntime}\n")
    return recipe


def image_facts() -> dict:
    facts = {}
    for image in (RUNTIME, BUILD):
        size = int(docker("image", "inspect", "-f", "{{.Size}}", image).stdout)
        facts[image] = {"size_mb": round(size / 1e6)}
    if facts[RUNTIME]["size_mb"] > MAX_RUNTIME_MB:
        raise Failed(f"{RUNTIME} is {facts[RUNTIME]['size_mb']} MB, over the {MAX_RUNTIME_MB} MB target")
    probe = docker("run", "--rm", "--entrypoint", "sh", RUNTIME, "-c",
                   "id -u; python -c 'import importlib.util as u; print(u.find_spec(\"torch\") is None)'; "
                   "command -v gcc cc c++ clang || true").stdout.split()
    if probe[0] == "0":
        raise Failed(f"{RUNTIME} runs as root")
    if probe[1] != "True":
        raise Failed(f"{RUNTIME} holds torch")
    if probe[2:]:
        raise Failed(f"{RUNTIME} holds a compiler: {probe[2:]}")
    return facts


def wait_healthy(timeout: float = 180) -> float:
    started = time.time()
    while time.time() - started < timeout:
        status = docker("inspect", "-f", "{{.State.Health.Status}}", CONTAINER).stdout.strip()
        if status == "healthy":
            return time.time() - started
        if docker("inspect", "-f", "{{.State.Running}}", CONTAINER).stdout.strip() != "true":
            raise Failed(f"the serving container stopped: {docker('logs', CONTAINER, check=False).stdout[-500:]}")
        time.sleep(0.5)
    raise Failed(f"the serving container's health check did not turn healthy in {timeout:g} s")


def check_answers(port: int, artifact: Path) -> None:
    """The real openai client against the container, the runtime outside Docker as the reference."""
    import openai

    from runtime.generator import Generator
    from runtime.sampling import SamplingParams

    reference = Generator.load(artifact, threads=2)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Say something about the sea"}]
    alone = reference.generate([messages], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    chat = client.chat.completions.create(model="tiny-docker", messages=messages, max_tokens=16, temperature=0,
                                          extra_body={"ignore_eos": True})
    if chat.choices[0].message.content != alone.text or chat.usage.completion_tokens != alone.generated_tokens:
        raise Failed(f"chat in Docker answered {chat.choices[0].message.content!r}, outside {alone.text!r}")
    prompt = "The quick brown fox"
    alone = reference.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    pieces = [chunk.choices[0].text for chunk in client.completions.create(
        model="tiny-docker", prompt=prompt, max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if chunk.choices]
    if "".join(pieces) != alone.text:
        raise Failed(f"the streamed completion in Docker answered {''.join(pieces)!r}, outside {alone.text!r}")


def check_stop_drains(port: int) -> None:
    """A long stream runs; `docker stop` (SIGTERM) lets it finish in full, and the container exits 0."""
    body = json.dumps({"model": "tiny-docker", "prompt": "The quick", "max_tokens": 2000, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"}, method="POST")
    response = urllib.request.urlopen(request, timeout=120)
    if not response.readline().startswith(b"data: "):
        raise Failed("the long stream did not start")
    stopping = threading.Thread(target=docker, args=("stop", "-t", "60", CONTAINER), kwargs={"timeout": 120})
    stopping.start()
    rest = response.read().decode()
    stopping.join()
    chunks = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
    if not (chunks and chunks[-1]["choices"][0]["finish_reason"] == "length" and rest.rstrip().endswith("[DONE]")):
        raise Failed("docker stop cut the running stream short instead of draining it")
    logs = docker("logs", CONTAINER).stdout
    if "SIGTERM: draining 1 running sequences" not in logs:
        raise Failed(f"the stream had ended before docker stop's SIGTERM landed: {logs[-400:]}")
    code = docker("inspect", "-f", "{{.State.ExitCode}}", CONTAINER).stdout.strip()
    if code != "0":
        raise Failed(f"the serving container exited {code} after docker stop, not 0")


def main() -> int:
    # SIGTERM (the suite stopping early) unwinds through the finally below: the container and the
    # dockerd this started are stopped, not left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(os.environ.get("KILN_DOCKER_ROOT", "/var/tmp/kiln-docker"))
    started = time.time()
    daemon = build = None
    try:
        daemon = start_engine(root)
        # Its lines (each step's time and size) as they come: a cold build takes minutes.
        build = subprocess.Popen(["bash", str(ROOT / "scripts" / "docker-build")], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        for line in build.stdout:
            print(line, end="", flush=True)
        if build.wait() != 0:
            raise Failed("scripts/docker-build failed (its lines are above)")
        facts = image_facts()
        with tempfile.TemporaryDirectory(prefix="kiln-docker-check-") as temporary:
            project = Path(temporary)
            recipe = tiny_project(project)
            compiling = time.time()
            done = docker("run", "--rm", "-v", f"{project}:/data", BUILD, "compile", recipe.name, "--out",
                          "/data/out/tiny-docker", check=False, timeout=900)
            if done.returncode != 0:
                raise Failed(f"compiling in {BUILD} failed: {(done.stderr or done.stdout)[-600:]}")
            say(f"{BUILD} compiled the tiny recipe in {time.time() - compiling:.0f} s")
            artifact = project / "out" / "tiny-docker"
            docker("run", "--rm", "-v", f"{project / 'out'}:/models:ro", RUNTIME, "verify", "/models/tiny-docker")
            say(f"{RUNTIME} verified it (mounted read-only)")
            docker("rm", "-f", CONTAINER, check=False)
            docker("run", "-d", "--name", CONTAINER, "-p", "127.0.0.1::8000", "-v", f"{project / 'out'}:/models:ro",
                   "-e", "KILN_THREADS=2", "--health-interval", "1s", "--health-start-period", "60s", RUNTIME,
                   "serve", "/models/tiny-docker", "--drain-timeout", "60")
            try:
                port = int(docker("port", CONTAINER, "8000/tcp").stdout.strip().splitlines()[0].rsplit(":", 1)[1])
                healthy = wait_healthy()
                say(f"serving on 127.0.0.1:{port}, healthy after {healthy:.1f} s")
                check_answers(port, artifact)
                say("the openai client's chat and streamed completion equal the runtime's outside Docker")
                check_stop_drains(port)
                say("docker stop drained a running stream to its end; exit code 0")
            finally:
                docker("rm", "-f", CONTAINER, check=False)
        sizes = ", ".join(f"{image} {fact['size_mb']} MB" for image, fact in facts.items())
        say(f"ok in {time.time() - started:.0f} s: {sizes} (runtime target {MAX_RUNTIME_MB} MB); "
            "runs as uid 10001, no torch, no compiler")
        return 0
    except CannotRun as reason:
        say(f"cannot run here: {reason}")
        return 3
    except (Failed, subprocess.TimeoutExpired, subprocess.CalledProcessError) as failure:
        say(f"FAILED: {failure}")
        return 1
    finally:
        if build is not None and build.poll() is None:  # stopped early: pip and docker build with it
            os.killpg(build.pid, signal.SIGTERM)
            build.wait(60)
        if daemon is not None:
            daemon.terminate()
            daemon.wait(60)
            say("stopped the dockerd it started")


if __name__ == "__main__":
    sys.exit(main())
