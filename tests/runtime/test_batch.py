"""kiln batch: both input formats, bad rows, resume after kill -9, a torn tail, bounded memory, Ray."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from runtime import batch
from runtime.errors import KilnError
from runtime.generator import Generator
from runtime.sampling import SamplingParams
from tests.conftest import small_tmpfs

WORDS = "the quick brown fox jumps over lazy dog cache keys values prefill decode token".split()


def kiln_batch(*args: object, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.kiln_cli", "batch", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def write_jsonl(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def simple_rows(count: int, seed: int = 0, max_tokens: int = 12) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"r{i}", "prompt": " ".join(rng.choices(WORDS, k=rng.randint(2, 20))),
             "max_tokens": rng.randint(1, max_tokens), "temperature": 0} for i in range(count)]


@pytest.fixture(scope="module")
def artifact(tiny_artifacts) -> Path:
    return tiny_artifacts["llama"]


def test_simple_rows_are_answered_as_generate_answers_them(artifact, tmp_path):
    rows = simple_rows(40) + [{"id": "chat", "messages": [{"role": "user", "content": "hi there"}],
                               "max_tokens": 6, "temperature": 0}]
    done = kiln_batch(artifact, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl")
    assert done.returncode == 0, done.stderr
    assert "41 done, 0 failed, 0 skipped" in done.stderr
    answers = {line["id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}
    assert set(answers) == {row["id"] for row in rows}
    assert not (tmp_path / "out.errors.jsonl").read_text()  # this run's errors: none

    generator = Generator.load(artifact)
    expected = generator.generate([row["prompt"] for row in rows[:-1]],
                                  [SamplingParams(max_new_tokens=row["max_tokens"]) for row in rows[:-1]])
    for row, result in zip(rows, expected, strict=False):
        answer = answers[row["id"]]
        assert (answer["text"], answer["usage"]["completion_tokens"]) == (result.text, result.generated_tokens)
        assert answer["finish_reason"] == {"eos": "stop", "length": "length"}[result.finish_reason]
        assert answer["error"] is None
    chat = generator.generate([[{"role": "user", "content": "hi there"}]], SamplingParams(max_new_tokens=6))[0]
    assert answers["chat"]["text"] == chat.text


def test_bad_rows_go_to_the_errors_file_with_line_and_reason(artifact, tmp_path):
    rows = [*simple_rows(5), "{not json", {"id": "neg", "prompt": "x", "temperature": -1},
            {"id": "none"}, {"id": "long", "prompt": "fox " * 30, "max_tokens": 120},
            {"id": "typo", "prompt": "x", "max_token": 3}, {"prompt": "no id"}, ["a list"],
            {"id": "n", "prompt": "the fox", "max_tokens": 3, "n": 2, "temperature": 0},
            "[" * 100_000, '{"id": "big", "prompt": "x", "seed": ' + "9" * 5000 + "}",
            '{"id": "\\ud800", "prompt": "x"}', '{"id": "cr1", "prompt": "a"}\r{"id": "cr2", "prompt": "b"}']
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    with open(source, "ab") as lines:
        lines.write(b'{"id": "latin1", "prompt": "caf\xe9"}\n')
    # chunks of 2 rows, smaller than the batch, some of them bad through and through
    done = kiln_batch(artifact, source, tmp_path / "out.jsonl", "--errors", tmp_path / "bad.jsonl",
                      "--chunk-rows", "2")
    assert done.returncode == 1, done.stderr
    assert "6 done, 12 failed, 0 skipped" in done.stderr
    assert {line["id"] for line in read_jsonl(tmp_path / "out.jsonl")} == {f"r{i}" for i in range(5)} | {"n"}
    errors = {line["line"]: line for line in read_jsonl(tmp_path / "bad.jsonl")}
    assert sorted(errors) == list(range(6, 13)) + list(range(14, 19))
    assert errors[6]["error"]["code"] == "invalid_json"
    assert errors[7]["id"] == "neg" and "temperature" in errors[7]["error"]["message"]
    assert errors[7]["error"]["param"] == "temperature"
    assert errors[8]["error"]["code"] == "missing_prompt"
    assert errors[9]["error"]["code"] == "context_length_exceeded"
    assert "max_token" in errors[10]["error"]["message"]  # our own format: a misspelt field is an error
    assert errors[11]["error"]["code"] == "missing_id"
    assert errors[12]["error"]["code"] == "invalid_json"
    assert errors[14]["error"]["code"] == errors[15]["error"]["code"] == "invalid_json"  # too deep, too long
    assert errors[16]["error"]["code"] == "invalid_id"  # a lone surrogate cannot be written as UTF-8
    assert errors[17]["error"]["code"] == "invalid_json"  # a stray \r splits no line: one line, not JSON
    assert errors[18]["error"]["code"] == "invalid_encoding"
    n = next(line for line in read_jsonl(tmp_path / "out.jsonl") if line["id"] == "n")
    assert len(n["choices"]) == 2 and n["usage"]["completion_tokens"] == 6


def test_openai_batch_lines_get_the_body_kiln_serve_returns(artifact, tmp_path):
    from .test_server import Server

    bodies = [("/v1/completions", {"model": "m", "prompt": "the quick fox", "max_tokens": 7, "temperature": 0,
                                   "logprobs": 2}),
              ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hello"}],
                                        "max_tokens": 5, "temperature": 0}),
              ("/v1/completions", {"model": "m", "prompt": ["a cache", "the dog jumps"], "max_tokens": 4,
                                   "temperature": 0})]
    rows = [{"custom_id": f"c{i}", "method": "POST", "url": url, "body": body} for i, (url, body) in enumerate(bodies)]
    rows += [{"custom_id": "emb", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}, "{oops"]
    done = kiln_batch(artifact, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl",
                      "--model-name", "m")
    assert done.returncode == 1, done.stderr
    lines = {line["custom_id"]: line for line in read_jsonl(tmp_path / "out.jsonl")}
    assert set(lines) == {"c0", "c1", "c2"}
    unsent, error = sorted(read_jsonl(tmp_path / "out.errors.jsonl"), key=lambda line: line["response"] is not None)
    # OpenAI's two error lines: a request answered with an error status, and a line that was no request
    assert (error["custom_id"], error["line"], error["response"]["status_code"]) == ("emb", 4, 400)
    assert error["error"] is None and error["response"]["body"]["error"]["code"] == "invalid_url"
    assert (unsent["line"], unsent["response"], unsent["error"]["code"]) == (5, None, "invalid_json")

    server = Server(artifact, "--model-name", "m", "--api-key", "k")
    try:
        for i, (url, body) in enumerate(bodies):
            line = lines[f"c{i}"]
            assert line["id"].startswith("batch_req_") and line["error"] is None
            assert line["response"]["status_code"] == 200
            status, _, served = server.post(url, body, key="k")
            assert status == 200, served
            answered = line["response"]["body"]
            for key in ("id", "created"):
                served.pop(key), answered.pop(key)
            # logprobs are float32 sums over different batches: equal to rounding, not to the bit
            logprobs = [(a.pop("logprobs"), s.pop("logprobs"))
                        for a, s in zip(answered["choices"], served["choices"], strict=True)]
            assert answered == served
            for ours, theirs in logprobs:
                assert (ours is None) == (theirs is None)
                if ours:
                    assert ours["tokens"] == theirs["tokens"] and ours["text_offset"] == theirs["text_offset"]
                    assert ours["token_logprobs"] == pytest.approx(theirs["token_logprobs"], abs=1e-4)
                    assert [sorted(t) for t in ours["top_logprobs"]] == [sorted(t) for t in theirs["top_logprobs"]]
    finally:
        assert server.stop() == 0


def test_kill_9_then_resume_loses_and_duplicates_nothing(artifact, tmp_path):
    rows = simple_rows(1500, seed=1, max_tokens=24)
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    clean = kiln_batch(artifact, source, tmp_path / "clean.jsonl")
    assert clean.returncode == 0, clean.stderr

    output = tmp_path / "out.jsonl"
    process = subprocess.Popen([sys.executable, "-m", "runtime.kiln_cli", "batch", str(artifact), str(source),
                                str(output), "--chunk-rows", "40"], stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (output.exists() and output.stat().st_size > 0):
        assert time.time() < deadline and process.poll() is None, "no output before the kill"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    written = len(output.read_text().splitlines())
    assert 0 < written < len(rows), "the kill came too late to test resume"

    resumed = kiln_batch(artifact, source, output)
    assert resumed.returncode == 0, resumed.stderr
    ids = [line["id"] for line in read_jsonl(output)]
    assert len(ids) == len(set(ids)) == len(rows)
    final = {line["id"]: line for line in read_jsonl(output)}
    assert final == {line["id"]: line for line in read_jsonl(tmp_path / "clean.jsonl")}


def test_sigterm_stops_cleanly_and_the_rerun_finishes(artifact, tmp_path):
    rows = simple_rows(1500, seed=3, max_tokens=24)
    source, output = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    process = subprocess.Popen([sys.executable, "-m", "runtime.kiln_cli", "batch", str(artifact), str(source),
                                str(output), "--chunk-rows", "40"], stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (output.exists() and output.stat().st_size > 0):
        assert time.time() < deadline and process.poll() is None, "no output before SIGTERM"
        time.sleep(0.01)
    second = kiln_batch(artifact, source, output)  # the same job started twice would write rows twice
    assert second.returncode == 2 and "another kiln batch is writing" in second.stderr
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 143  # 128 + SIGTERM, the shell convention
    assert "rerun the same command to resume" in process.stderr.read()
    text = output.read_text()
    assert text.endswith("\n") and 0 < len(read_jsonl(output)) < len(rows)  # every line whole
    assert kiln_batch(artifact, source, output).returncode == 0
    assert sorted(line["id"] for line in read_jsonl(output)) == sorted(row["id"] for row in rows)


@pytest.mark.parametrize("form", ["simple, integer ids", "openai"])
def test_a_torn_last_line_is_trimmed_on_resume(artifact, tmp_path, form):
    rows = [{**row, "id": i} for i, row in enumerate(simple_rows(6))]
    if form == "openai":
        rows = [{"custom_id": f"c{row.pop('id')}", "method": "POST", "url": "/v1/completions",
                 "body": {"model": "m", **row}} for row in rows]
    key = "custom_id" if form == "openai" else "id"
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    assert kiln_batch(artifact, source, output).returncode == 0
    lines = output.read_text().splitlines(keepends=True)
    output.write_text("".join(lines[:3]) + lines[3][:17])  # as a kill in mid-write leaves it
    resumed = kiln_batch(artifact, source, output)
    assert resumed.returncode == 0, resumed.stderr
    assert "trimmed a torn last line (17 bytes)" in resumed.stderr
    assert "3 done, 0 failed, 3 skipped" in resumed.stderr
    assert sorted(line[key] for line in read_jsonl(output)) == sorted(row[key] for row in rows)


def test_duplicate_ids_and_bad_paths_are_refused_before_anything_is_written(artifact, tmp_path):
    rows = simple_rows(4) + [{"id": "r1", "prompt": "again"}, {"id": "r3", "prompt": "again"}]
    done = kiln_batch(artifact, write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl")
    assert done.returncode == 2
    assert '"r1" on lines 2 and 5; "r3" on lines 4 and 6' in done.stderr
    assert not (tmp_path / "out.jsonl").exists()

    good = write_jsonl(tmp_path / "good.jsonl", simple_rows(2))
    same = kiln_batch(artifact, good, good)
    assert same.returncode == 2 and "three different files" in same.stderr
    missing = kiln_batch(artifact, good, tmp_path / "no" / "out.jsonl")
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    no_artifact = kiln_batch(tmp_path / "nothing", good, tmp_path / "out.jsonl")
    assert no_artifact.returncode == 2 and len(no_artifact.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()


def test_a_bad_line_in_output_is_refused_not_overwritten(artifact, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", simple_rows(3))
    output = tmp_path / "out.jsonl"
    output.write_text("some notes of mine\n{}\n")
    done = kiln_batch(artifact, source, output)
    assert done.returncode == 2 and "line 1 is not a line kiln batch wrote" in done.stderr
    assert output.read_text() == "some notes of mine\n{}\n"
    fresh = kiln_batch(artifact, source, output, "--no-resume")
    assert fresh.returncode == 0 and len(read_jsonl(output)) == 3


def test_python_api_and_command_line_defaults(artifact):
    rows = [{"id": 1, "prompt": "the fox"}, {"id": 2, "prompt": "the dog", "max_tokens": 2}]
    lines = {line["id"]: line for line in batch.run(artifact, rows, defaults={"max_tokens": 5, "temperature": 0})}
    assert lines[1]["usage"]["completion_tokens"] <= 5 and lines[2]["usage"]["completion_tokens"] <= 2
    expected = Generator.load(artifact).generate(["the fox"], SamplingParams(max_new_tokens=5))[0]
    assert lines[1]["text"] == expected.text


def test_memory_stays_bounded_on_a_long_input(artifact, tmp_path):
    """20,000 short rows, then 200,000: the peak RSS grows by the id index alone (each id's line, kept
    for the duplicate check and resume: about 117 bytes a row measured), not by what was read, is
    pending or was answered. Compared run against run, not with a size measured once."""
    # VmHWM, not getrusage's ru_maxrss: that one keeps the forking parent's (pytest's) size across exec.
    script = ("import sys\nfrom runtime import kiln_cli\n"
              "try:\n    kiln_cli.kiln(sys.argv[1:])\n"
              "finally:\n    status = open('/proc/self/status').read()\n"
              "    print('peak_rss_kb', int(status.split('VmHWM:')[1].split()[0]), file=sys.stderr)\n")

    def peak_kb(rows: int) -> int:
        source, output = tmp_path / f"in{rows}.jsonl", tmp_path / f"out{rows}.jsonl"
        with open(source, "w") as lines:
            for i in range(rows):
                lines.write(json.dumps({"id": i, "prompt": WORDS[i % len(WORDS)] + " fox", "max_tokens": 1,
                                        "temperature": 0}) + "\n")
        done = subprocess.run([sys.executable, "-c", script, "batch", str(artifact), str(source), str(output),
                               "--batch-size", "128"], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
        with open(output) as answers:
            assert sum(1 for _ in answers) == rows
        return int(done.stderr.rsplit("peak_rss_kb", 1)[1].split()[0])

    small, large = peak_kb(20_000), peak_kb(200_000)
    per_row = (large - small) * 1024 / 180_000
    assert per_row < 200, f"peak RSS {small // 1024} MiB at 20,000 rows, {large // 1024} MiB at 200,000: " \
                          f"{per_row:.0f} bytes a row more"


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             logging_level="warning")
    yield ray
    ray.shutdown()


def test_ray_path_writes_what_the_local_path_writes(artifact, tmp_path, local_ray):
    rows = simple_rows(120, seed=2) + ["{broken", {"id": "bad", "prompt": "x", "top_p": 0}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    local = batch.run_job(batch.BatchConfig(artifact, source, tmp_path / "local.jsonl"))
    config = batch.BatchConfig(artifact, source, tmp_path / "ray.jsonl", ray=True, workers=2, chunk_rows=32)
    on_ray = batch.run_job(config)
    assert (local.done, local.failed) == (on_ray.done, on_ray.failed) == (120, 2)
    by_id = {line["id"]: line for line in read_jsonl(tmp_path / "local.jsonl")}
    assert {line["id"]: line for line in read_jsonl(tmp_path / "ray.jsonl")} == by_id
    def errors(name: str) -> list[dict]:
        return sorted(read_jsonl(tmp_path / name), key=lambda line: line["line"])

    assert errors("ray.errors.jsonl") == errors("local.errors.jsonl")
    assert [line["line"] for line in errors("ray.errors.jsonl")] == [121, 122]

    # resume on Ray is keyed by id too: drop half the answers and run again
    kept = read_jsonl(tmp_path / "ray.jsonl")[:60]
    write_jsonl(tmp_path / "ray.jsonl", kept)
    again = batch.run_job(config)
    assert (again.done, again.skipped) == (60, 60)
    assert {line["id"]: line for line in read_jsonl(tmp_path / "ray.jsonl")} == by_id

    # Ray Data's reader splits lines at \r and U+2028 too: such a file is refused up front, not misread
    write_jsonl(source, rows + ['{"id": "cr1", "prompt": "a"}\r{"id": "cr2", "prompt": "b"}'])
    with pytest.raises(KilnError, match="line 123 holds a line break other than"):
        batch.run_job(replace(config, output=tmp_path / "split.jsonl"))
    assert not (tmp_path / "split.jsonl").exists()


def test_a_ray_worker_killed_mid_job_loses_and_repeats_no_row(artifact, tmp_path):
    """SIGKILL to one of two Ray actors while rows are being answered: Ray restarts it and runs its batch
    again; the job exits 0 with every row in OUTPUT exactly once."""
    pytest.importorskip("ray")
    rows = simple_rows(3000, seed=5, max_tokens=24)
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    output = tmp_path / "out.jsonl"
    job = subprocess.Popen([sys.executable, "-m", "runtime.kiln_cli", "batch", str(artifact), str(source), str(output),
                            "--workers", "2", "--chunk-rows", "64", "--ray"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    victim, seen_at = None, None
    deadline = time.monotonic() + 300
    while job.poll() is None and time.monotonic() < deadline:
        found = subprocess.run(["pgrep", "-f", r"MapBatches\(RayWorker\)"], capture_output=True,
                               text=True).stdout.split()
        seen_at = seen_at or (time.monotonic() if found else None)
        if found and time.monotonic() - seen_at > 2:  # answering by now: its session loads in well under that
            victim = int(found[0])
            os.kill(victim, signal.SIGKILL)
            break
        time.sleep(0.1)
    assert victim is not None and job.poll() is None, "the job ended before a worker could be killed mid-job"
    _, stderr = job.communicate(timeout=600)
    assert job.returncode == 0, stderr
    ids = [line["id"] for line in read_jsonl(output)]
    assert len(ids) == len(set(ids)) == len(rows) and set(ids) == {row["id"] for row in rows}
    assert "3,000 done, 0 failed" in stderr


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KiB tmpfs of this test's own (root only), unmounted after it."""
    with small_tmpfs(tmp_path / "disk", "64k") as folder:
        yield folder


def test_a_full_disk_stops_the_job_in_one_line_and_a_rerun_with_room_finishes_it(artifact, tmp_path, small_disk):
    """The output's disk fills mid-job: one line naming the file and its free space, a non-zero exit, the
    file cut back to whole lines; with room made, the same command answers the rest, each row once."""
    source = write_jsonl(tmp_path / "in.jsonl", simple_rows(1500, max_tokens=2))
    output = small_disk / "out.jsonl"
    full = kiln_batch(artifact, source, output, "--chunk-rows", "100", "--threads", "1")
    lines = full.stderr.strip().splitlines()
    assert full.returncode != 0 and f"cannot write {output}: No space left on device" in lines[-1], full.stderr
    assert "bytes free there" in lines[-1] and "Traceback" not in full.stderr
    written = output.read_bytes()
    assert written and written.endswith(b"\n")  # whole lines only: no torn one left behind
    kept = {row["id"] for row in read_jsonl(output)}
    assert 0 < len(kept) < 1500
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    resumed = kiln_batch(artifact, source, output, "--threads", "1")
    assert resumed.returncode == 0, resumed.stderr
    assert f"{len(kept):,} skipped" in resumed.stderr
    ids = [row["id"] for row in read_jsonl(output)]
    assert sorted(ids) == sorted(row["id"] for row in read_jsonl(source)) and len(ids) == len(set(ids))


def test_an_output_removed_while_the_job_runs_is_said_in_one_line(tmp_path):
    """A sink whose file is removed (or whose folder is) after its last sync: the next sync says so,
    instead of writing answers to a file no one can read."""
    sink = batch._Sink(tmp_path / "out.jsonl", "a")
    sink.write({"id": 1})
    sink.sync()
    (tmp_path / "out.jsonl").unlink()
    sink.write({"id": 2})
    with pytest.raises(KilnError, match="cannot write .*out.jsonl: removed while the job ran"):
        sink.sync()
    sink.close()  # once failed, closing neither writes nor raises
