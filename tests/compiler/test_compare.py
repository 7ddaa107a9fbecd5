"""compare-model for real on tiny models: eager torch against compiled artifacts, gates, exit codes, reports."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from compiler.accuracy import GATES, cosine, kl_divergence
from compiler.cli import compare_main
from compiler.recipe import Gates
from compiler.report import PROMPT_COLUMNS, SUMMARY_ROWS, fmt

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Gates an exact build must hold against eager torch (fp32 kernels differ in order only).
EXACT = ["top1_agreement=1", "greedy_match=1", "kl_divergence=1e-6", "max_logit_error=1e-3",
         "prefill_cosine=0.99999", "perplexity_change=1e-4"]


def run(*args: str) -> object:
    return CliRunner().invoke(compare_main, ["--max-new-tokens", "6", "--speed-repeats", "1", *map(str, args)])


@pytest.fixture(scope="module")
def corrupted(tiny_artifacts, tmp_path_factory) -> Path:
    """The tiny Llama artifact with noise added to its MLP weights in the ONNX initializers."""
    folder = tmp_path_factory.mktemp("corrupted") / "tiny-llama"
    shutil.copytree(tiny_artifacts["llama"], folder)
    path = folder / "variants" / "cpu-fp32" / "model.onnx"
    model = onnx.load(str(path), load_external_data=False)
    rng = np.random.default_rng(0)
    # Rewritten in place in model.onnx.data, so every file keeps its size and only the digests tell.
    with open(path.with_name("model.onnx.data"), "r+b") as data:
        for init in model.graph.initializer:
            entries = {e.key: e.value for e in init.external_data}
            shape = tuple(init.dims)
            if len(shape) == 2 and 128 in shape:  # the MLP projections (hidden 64, intermediate 128)
                data.seek(int(entries["offset"]))
                weights = np.frombuffer(data.read(int(entries["length"])), np.float32)
                noisy = weights + rng.normal(0, weights.std(), weights.shape).astype(np.float32)
                data.seek(int(entries["offset"]))
                data.write(noisy.tobytes())
    return folder


def test_known_equal_pair_passes_every_gate(tiny_checkpoints, tiny_artifacts, family, tmp_path):
    result = run(f"eager:{tiny_checkpoints[family]}", f"{tiny_artifacts[family]}:cpu-fp32",
                 *[x for g in EXACT for x in ("--gate", g)], "--report", tmp_path)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and report["failed_gates"] == [] and len(report["gates"]) == len(EXACT)
    summary = report["summary"]
    assert summary["greedy_match"] == 1.0 and summary["top1_agreement"] == 1.0
    assert summary["kl_divergence"] < 1e-8 and summary["prefill_cosine"] > 0.999999
    assert summary["tokens_per_second"] > 0 and summary["tokens_per_second_reference"] > 0
    assert all(p["first_divergence"] is None and p["reference_tokens"] == p["candidate_tokens"]
               for p in report["prompts"])
    assert "gates: PASS" in result.stdout


def test_corrupted_weights_fail_the_right_gates(tiny_checkpoints, corrupted, tmp_path):
    gates = tmp_path / "gates.yaml"  # a recipe's `gates:` block works as a gates file
    gates.write_text("gates: {top1_agreement: 0.99, kl_divergence: 0.001, max_logit_error: 0.01, "
                     "perplexity_change: 10, tokens_per_second_ratio: 0.001}\n")
    refused = run(f"eager:{tiny_checkpoints['llama']}", f"{corrupted}:cpu-fp32", "--gates", gates)
    assert refused.exit_code == 2 and "fails its sha256 check" in refused.stderr  # changed after compile

    result = run(f"eager:{tiny_checkpoints['llama']}", f"{corrupted}:cpu-fp32", "--gates", gates, "--no-verify",
                 "--report", tmp_path / "report")
    assert result.exit_code == 1, result.output
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    failed = sorted(line.split()[0] for line in report["failed_gates"])
    assert failed == ["kl_divergence", "max_logit_error", "top1_agreement"]
    gate_lines = [line for line in result.stderr.splitlines() if line.startswith("compare-model: gate failed: ")]
    assert sorted(line.split()[3] for line in gate_lines) == failed
    assert report["summary"]["greedy_match"] < 1 and any(p["first_divergence"] is not None for p in report["prompts"])


def test_artifact_against_itself_and_its_unfused_twin(tiny_artifacts):
    folder = tiny_artifacts["qwen2"]
    same = run(f"{folder}:cpu-fp32", f"{folder}:cpu-fp32", "--gate", "max_logit_error=1e-9")
    assert same.exit_code == 0, same.output
    twin = run(f"{folder}:cpu-fp32-unfused", f"{folder}:cpu-fp32", *[x for g in EXACT for x in ("--gate", g)])
    assert twin.exit_code == 0, twin.output


def test_default_gates_are_the_ones_b_was_compiled_with(tiny_artifacts, tmp_path):
    manifest = json.loads((tiny_artifacts["llama"] / "manifest.json").read_text())
    assert manifest["variants"]["cpu-fp32"]["gates"] == {}  # the tiny recipes set none
    result = run(f"{tiny_artifacts['llama']}", f"{tiny_artifacts['llama']}:cpu-fp32-unfused", "--report", tmp_path)
    assert result.exit_code == 0 and "gates: no gates given" in result.stdout
    assert "NO GATES" in (tmp_path / "report.md").read_text()


def _swapped_tokenizer(checkpoint: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "other"
    shutil.copytree(checkpoint, folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


@pytest.mark.parametrize("case", ["tokenizer", "empty prompts", "missing artifact", "missing variant",
                                  "unknown gate", "bad gate value", "missing eager source"])
def test_bad_input_exits_2_with_one_line(case, tiny_checkpoints, tiny_artifacts, tmp_path):
    artifact, checkpoint = tiny_artifacts["llama"], tiny_checkpoints["llama"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    args, expected = {
        "tokenizer": ([f"eager:{_swapped_tokenizer(checkpoint, tmp_path)}", artifact], "different tokenizers"),
        "empty prompts": ([artifact, artifact, "--prompts", empty], "no prompts"),
        "missing artifact": ([artifact, tmp_path / "nowhere"], "not a Kiln artifact"),
        "missing variant": ([artifact, f"{artifact}:gpu-fp16"], "no variant 'gpu-fp16'"),
        "unknown gate": ([artifact, artifact, "--gate", "accuracy=0.9"], "gate 'accuracy' is unknown"),
        "bad gate value": ([artifact, artifact, "--gate", "top1_agreement=2"], "top1_agreement"),
        "missing eager source": (["eager:" + str(tmp_path / "nothing"), artifact], "model.source"),
    }[case]
    result = run(*args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("compare-model: error: ") and expected in lines[-1], lines


def test_gate_table_matches_the_recipe_schema():
    assert set(GATES) == set(Gates.model_fields)


def test_kl_and_cosine():
    p = np.log(np.array([[0.5, 0.25, 0.25]]))
    q = np.log(np.array([[0.25, 0.5, 0.25]]))
    assert kl_divergence(p, p)[0] == 0
    assert kl_divergence(p, q)[0] == pytest.approx(0.25 * np.log(2))  # 0.5 ln 2 - 0.25 ln 2
    assert kl_divergence(p + 7.0, q)[0] == pytest.approx(0.25 * np.log(2))  # logits, not probabilities
    assert cosine(np.array([1.0, 0.0]), np.array([1.0, 1.0])) == pytest.approx(2 ** -0.5)


@pytest.fixture(scope="module")
def written_report(tiny_checkpoints, corrupted, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("report")
    result = run(f"eager:{tiny_checkpoints['llama']}", f"{corrupted}:cpu-fp32", "--no-verify", "--report", folder,
                 "--gate", "top1_agreement=0.99", "--gate", "perplexity_change=10")
    assert result.exit_code == 1, result.output
    return folder


def test_report_files_hold_the_json_numbers(written_report):
    report = json.loads((written_report / "report.json").read_text())
    md = (written_report / "report.md").read_text()
    page = (written_report / "report.html").read_text()
    for text in (md, page):
        for _, key, _ in SUMMARY_ROWS:
            assert fmt(key, report["summary"][key]) in text, key
        for prompt in report["prompts"]:
            for _, key, spec in PROMPT_COLUMNS:
                assert format(prompt[key], spec) in text
        assert "FAIL (1 of 2 gates)" in text
    for fetch in ('src="http', "href='http", 'href="http', "<link", "<script", "@import", "url(http"):
        assert fetch not in page, fetch  # the page stands alone: nothing to fetch
    assert page.count("<svg") == 2


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (scripts/setup installs it as root)")
def test_html_report_renders_in_headless_chromium(written_report, tmp_path):
    report = json.loads((written_report / "report.json").read_text())
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    url = (written_report / "report.html").resolve().as_uri()
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    assert "FAIL (1 of 2 gates)" in dom
    for key in ("top1_agreement", "kl_divergence", "perplexity_change", "tokens_per_second_ratio"):
        assert fmt(key, report["summary"][key]) in dom
    shot = tmp_path / "report.png"
    subprocess.run([CHROMIUM, *flags, "--window-size=1200,1600", f"--screenshot={shot}", url],
                   capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 20_000  # a page with tables and two plots, not a blank one


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_eager_scores_a_row_in_one_pass_as_in_steps(tiny_checkpoints, family):
    """The reference's teacher-forced logits come from one forward pass per row (EagerBackend.forward_row);
    they equal one decode step per column over the left-padded rows, as every other backend is run,
    to fp32 rounding, whole rows and their last positions alike."""
    from transformers import AutoModelForCausalLM

    from compiler.accuracy import teacher_forced
    from compiler.eager import EagerBackend

    class InSteps:  # the same backend, without forward_row
        def __init__(self, backend: EagerBackend) -> None:
            self.new_cache, self.run = backend.new_cache, backend.run

    backend = EagerBackend(AutoModelForCausalLM.from_pretrained(tiny_checkpoints[family]).eval())
    rng = np.random.default_rng(0)
    rows = [[int(t) for t in rng.integers(1, 200, n)] for n in (40, 17, 33)]
    for last in (None, 9):
        one_pass, in_steps = teacher_forced(backend, rows, 0, last), teacher_forced(InSteps(backend), rows, 0, last)
        assert [a.shape for a in one_pass] == [(last or len(r), backend.vocab_size) for r in rows]
        for a, b in zip(one_pass, in_steps, strict=True):
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max() and (a.argmax(-1) == b.argmax(-1)).all()


def test_sigterm_exits_143_and_leaves_no_logits_behind(tiny_checkpoints, tiny_artifacts, tmp_path):
    """Both sides' logits go to a temporary folder (0.3 GiB at SmolLM2's vocabulary); a compare stopped
    by SIGTERM removes it on the way out, as Ctrl-C does."""
    import os
    import signal
    import sys
    import time

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    command = [str(Path(sys.executable).with_name("compare-model")), f"eager:{tiny_checkpoints['llama']}",
               f"{tiny_artifacts['llama']}:cpu-fp32", "--speed-repeats", "50"]
    process = subprocess.Popen(command, env={**os.environ, "TMPDIR": str(scratch)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not any(scratch.glob("kiln-compare-*/a")) and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, process.stderr.read().decode()
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 143
    assert not list(scratch.glob("kiln-compare-*"))  # torch leaves caches of its own in TMPDIR
