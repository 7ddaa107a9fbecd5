"""kiln serve on loopback, driven by the official openai client and by raw HTTP: answers, concurrency,
faults, metrics, and the drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from runtime.generator import Generator
from runtime.sampling import SamplingParams

KEY = "test-key"
MODEL = "tiny-serve"


class Server:
    """`kiln serve` in a subprocess on a free loopback port; stop() sends SIGTERM and waits."""

    def __init__(self, artifact: Path, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "runtime.kiln_cli", "serve", str(artifact), "--host", "127.0.0.1", "--port", "0",
             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        first = self.process.stdout.readline()
        self.lines.append(first)
        match = re.search(r"(http://127\.0\.0\.1:\d+)/v1", first)
        assert match, first + self.process.stdout.read()
        self.url = match.group(1)
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.time() + 60
        while self.get("/health")[0] != 200:
            assert time.time() < deadline and self.process.poll() is None, "".join(self.lines)
            time.sleep(0.05)

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def request(self, method: str, path: str, body: bytes | None = None, key: str | None = KEY,
                timeout: float = 30) -> tuple[int, dict, bytes]:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self.url + path, body, headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
        except urllib.error.HTTPError as error:
            return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()
        except OSError:
            return 0, {}, b""

    def get(self, path: str) -> tuple[int, dict, bytes]:
        return self.request("GET", path)

    def post(self, path: str, payload: dict | bytes, key: str | None = KEY) -> tuple[int, dict, dict]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        status, headers, data = self.request("POST", path, body, key)
        return status, headers, json.loads(data) if data else {}

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        values = {}
        for family in text_string_to_metric_families(self.get("/metrics")[2].decode()):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return values

    def client(self, asynchronous: bool = False):
        import openai

        kind = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return kind(api_key=KEY, base_url=self.url + "/v1", max_retries=0, timeout=120)

    def stop(self, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


@pytest.fixture(scope="module")
def server(serve_artifact):
    running = Server(serve_artifact, "--api-key", KEY, "--max-batch-size", "16", "--threads", "2")
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def reference(serve_artifact) -> Generator:
    return Generator.load(serve_artifact, threads=2)


PROMPTS = ["The quick brown fox", "A KV cache keeps", "def add(a, b):", "Paris is the capital of France. Berlin"]


def test_openai_client_completions(server, reference):
    client = server.client()
    alone = reference.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12))[0]
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert answer.choices[0].text == alone.text
    assert answer.choices[0].finish_reason == ("stop" if alone.finish_reason == "eos" else "length")
    assert answer.usage.prompt_tokens == alone.prompt_tokens
    assert answer.usage.completion_tokens == alone.generated_tokens
    assert answer.usage.total_tokens == alone.prompt_tokens + alone.generated_tokens
    # Several prompts, n each, choices ordered prompt by prompt.
    many = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=5, temperature=0, n=2,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    expected = reference.generate(PROMPTS[:2], SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [c.text for c in many.choices] == [expected[0].text] * 2 + [expected[1].text] * 2
    assert many.usage.completion_tokens == 20
    # Token ids as the prompt, streamed, with logprobs.
    ids = reference.encode(PROMPTS[1])
    pieces, finish = [], None
    for chunk in client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, stream=True,
                                           logprobs=2, extra_body={"ignore_eos": True}):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
        if chunk.choices[0].logprobs and chunk.choices[0].logprobs.token_logprobs:
            assert len(chunk.choices[0].logprobs.top_logprobs[0]) == 2
    six = reference.generate([ids], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert "".join(pieces) == six.text and finish == "length"


def test_openai_client_chat(server, reference):
    client = server.client()
    messages = [{"role": "user", "content": "Paris is the capital of"}]
    alone = reference.generate([messages], SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=3))[0]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                            logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == alone.text
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx([t.logprob for t in alone.logprobs])
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert answer.usage.prompt_tokens == alone.prompt_tokens
    # Streaming: the role first, the text in pieces, the finish reason once, the usage chunk last.
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_stop_sequences_seed_and_max_tokens(server, reference):
    client = server.client()
    free = reference.generate([PROMPTS[2]], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2:][:2]
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == free.text[: free.text.find(stop)]
    sampled = [client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=1.0, top_p=0.9,
                                         seed=42).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]  # the same seed, the same draws, whatever shared the batch
    short = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_beam_search_as_vllm_takes_it(server, reference):
    client = server.client()
    beams = reference.generate([PROMPTS[1]], SamplingParams(max_new_tokens=8, num_beams=3, n=2))[0]
    answer = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, n=2, best_of=3,
                                       extra_body={"use_beam_search": True})  # 3 beams, the best 2 back
    assert [c.text for c in answer.choices] == [beams.text, beams.alternatives[0].text]
    assert answer.usage.completion_tokens == beams.generated_tokens + beams.alternatives[0].generated_tokens
    messages = [{"role": "user", "content": PROMPTS[0]}]
    alone = reference.generate([messages], SamplingParams(max_new_tokens=8, num_beams=4, length_penalty=2.0))[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                          extra_body={"num_beams": 4, "length_penalty": 2.0})
    assert chat.choices[0].message.content == alone.text
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"num_beams": 4, "length_penalty": 2.0}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == alone.text
    assert streamed[-1].usage.completion_tokens == alone.generated_tokens


def test_64_concurrent_staggered_requests_each_get_their_alone_answer(server, reference):
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over the lazy dog while a KV cache keeps keys".split()
    prompts = [" ".join(rng.choice(words, int(rng.integers(1, 40)))) for _ in range(64)]
    max_tokens = [int(rng.integers(1, 48)) for _ in range(64)]
    delays = sorted(rng.uniform(0, 1.5, 64))
    expected = [reference.generate([p], SamplingParams(max_new_tokens=m, ignore_eos=True))[0].text
                for p, m in zip(prompts, max_tokens, strict=True)]

    async def one(client, index: int) -> str:
        await asyncio.sleep(delays[index])
        answer = await client.completions.create(model=MODEL, prompt=prompts[index], max_tokens=max_tokens[index],
                                                 temperature=0, extra_body={"ignore_eos": True})
        return answer.choices[0].text

    async def everyone() -> list[str]:
        async with server.client(asynchronous=True) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    answers = asyncio.run(everyone())
    assert answers == expected


LONGEST = 2000  # new tokens after "The quick" (5 tokens) within the tiny artifact's 2,048 slots


def _long_stream(server, max_tokens: int = LONGEST):
    """A streamed completion that decodes for seconds (the longest the context allows, so a signal or a
    disconnect sent after its first token lands while it runs); returns the response once its first token
    came."""
    body = json.dumps({"model": MODEL, "prompt": "The quick", "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(server.url + "/v1/completions", body, {
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}, method="POST")
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")
    return response


def _wait_for(condition, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_the_row(server):
    before = server.metrics()
    response = _long_stream(server)
    assert server.metrics()["kiln:num_requests_running"] == 1
    response.close()  # the client goes away mid-stream
    _wait_for(lambda: server.metrics()["kiln:num_requests_running"] == 0)
    after = server.metrics()
    aborted = "kiln:request_success_total{finished_reason=abort}"
    assert after[aborted] - before.get(aborted, 0) == 1
    assert after["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] < LONGEST


def test_full_queue_gives_429_with_retry_after(serve_artifact):
    small = Server(serve_artifact, "--max-batch-size", "1", "--max-queue", "1", "--threads", "1")
    try:
        running = _long_stream(small)  # holds the one row
        waiting = threading.Thread(target=small.post, args=("/v1/completions", {
            "model": MODEL, "prompt": "waits", "max_tokens": 2}))
        waiting.start()  # takes the one place in the queue
        _wait_for(lambda: small.metrics()["kiln:num_requests_waiting"] == 1)
        status, headers, body = small.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert status == 429 and headers["retry-after"] == "1"
        assert body["error"]["type"] == "rate_limit_error" and "queue is full" in body["error"]["message"]
        running.close()
        waiting.join(60)
        assert small.metrics()["kiln:request_rejected_total{status=429}"] == 1
    finally:
        assert small.stop() == 0


@pytest.mark.parametrize("payload, status, param, message", [
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", "valid number"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
    ({"model": MODEL}, 400, "prompt", "Field required"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty", "not supported"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
    ({"model": MODEL, "prompt": "x " * 3000}, 400, "prompt", "maximum context length is 2048 tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "you requested 5001 tokens (1 in the "
                                                                               "prompt, 5000 for the completion)"),
    ({"model": MODEL, "prompt": [[]]}, 400, "prompt", "must not be empty"),
    ({"model": MODEL, "prompt": [999999]}, 400, "prompt", "token ids must be in [0, 320)"),
    ({"model": MODEL, "prompt": "x", "use_beam_search": True, "n": 2, "temperature": 0.8}, 400, "prompt",
     "set temperature to 0"),
    ({"model": MODEL, "prompt": "x", "num_beams": 2, "n": 3}, 400, "prompt", "must be <= num_beams"),
    ({"model": MODEL, "prompt": "x", "num_beams": 2, "early_stopping": "soon"}, 400, "early_stopping", "never"),
])
def test_bad_requests_get_openai_shaped_errors(server, payload, status, param, message):
    code, _, body = server.post("/v1/completions", payload)
    assert code == status, body
    assert body["error"]["param"] == param and message in body["error"]["message"]


def test_a_chat_message_of_a_role_openai_does_not_have_is_a_400(server):
    """The real openai client sends the body as given; the server answers 400 as OpenAI's API does."""
    import openai

    client = server.client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, max_tokens=4,
                                       messages=[{"role": "user", "content": "Hi"}, {"role": "wizard", "content": "x"}])
    assert refused.value.status_code == 400 and "'wizard'" in refused.value.message
    answer = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": "Say hi"}])
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_malformed_json_missing_key_and_unknown_route(server):
    status, _, body = server.post("/v1/chat/completions", b'{"model": "tiny-serve", "messages": [')
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, _, body = server.post("/v1/completions", {"model": MODEL, "prompt": "x"}, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert server.post("/v1/completions", {"model": MODEL, "prompt": "x"}, key="wrong")[0] == 401
    assert server.request("GET", "/v1/models", key=None)[0] == 401
    assert json.loads(server.get("/v1/models")[2])["data"][0]["id"] == MODEL
    assert server.get("/v1/nothing")[0] == 404


def test_metrics_parse_and_add_up(server):
    before = server.metrics()
    client = server.client()
    answers = [client.completions.create(model=MODEL, prompt=p, max_tokens=4 + i, temperature=0, n=1 + i % 2,
                                         extra_body={"ignore_eos": True}) for i, p in enumerate(PROMPTS)]
    after = server.metrics()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0)

    assert grew("kiln:prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    assert grew("kiln:generation_tokens_total") == sum(a.usage.completion_tokens for a in answers)
    sequences = sum(len(a.choices) for a in answers)
    assert grew("kiln:request_success_total{finished_reason=length}") == sequences
    assert grew("kiln:time_to_first_token_seconds_count") == sequences
    assert grew("kiln:e2e_request_latency_seconds_count") == sequences
    assert grew("kiln:inter_token_latency_seconds_count") == sum(a.usage.completion_tokens for a in answers) - sequences
    assert after["kiln:num_requests_running"] == 0 and after["kiln:num_requests_waiting"] == 0
    for name in ("kiln:batch_size", "kiln:kv_cache_slots_used", "kiln:request_queue_time_seconds_count"):
        assert name in after


def test_sigterm_drains_running_requests_then_exits_0(serve_artifact):
    draining = Server(serve_artifact, "--threads", "1")
    response = _long_stream(draining)
    draining.process.send_signal(signal.SIGTERM)
    _wait_for(lambda: any("draining" in line for line in draining.lines))
    assert any("SIGTERM: draining 1 running sequences" in line for line in draining.lines)
    assert draining.request("GET", "/health", timeout=2)[0] in (0, 503)  # no longer admitting
    rest = response.read().decode()  # the running request still finishes in full
    chunks = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and rest.rstrip().endswith("data: [DONE]")
    assert draining.process.wait(60) == 0
    assert "kiln serve: stopped" in "".join(draining.lines)


def test_health_is_503_until_the_model_is_loaded(serve_artifact):
    import socket

    import uvicorn

    from runtime.model import select_variant
    from runtime.server import ServeConfig, Service, create_app

    service = Service(ServeConfig(serve_artifact, threads=1), select_variant(serve_artifact))
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"

    def status(path: str, body: bytes | None = None) -> int:
        try:
            with urllib.request.urlopen(urllib.request.Request(url + path, body, {
                    "Content-Type": "application/json"}), timeout=10) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return 0

    try:
        _wait_for(lambda: status("/health") == 503)
        completion = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
        assert status("/v1/completions", completion) == 503
        service.load()
        assert status("/health") == 200 and status("/v1/completions", completion) == 200
        # a server's engine keeps the prefill budget between decode steps (a bulk call's does not)
        assert service.engine.prefill_first is False
    finally:
        server.should_exit = True
        thread.join(30)


def test_serve_refuses_bad_input_in_one_line(serve_artifact, tmp_path):
    import socket

    def serve(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "runtime.kiln_cli", "serve", *args], capture_output=True,
                              text=True, timeout=60)

    missing = serve(str(tmp_path / "nothing"))
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"kiln serve: error: {tmp_path / 'nothing'}: not a Kiln artifact (no manifest.json)"
    unknown = serve(str(serve_artifact), "--variant", "gpu")
    assert unknown.returncode == 2 and "no built variant 'gpu'; built variants: cpu-fp32" in unknown.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = serve(str(serve_artifact), "--port", str(taken.getsockname()[1]))
    assert busy.returncode == 2 and busy.stderr.startswith("kiln serve: error: cannot listen on 127.0.0.1:")
    assert len(busy.stderr.strip().splitlines()) == 1


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    """Said from Content-Length, with the body never sent; a chunked body without a length is cut off at
    the limit; both counted as rejected; a body under the limit is answered."""
    import http.client

    from runtime.server import MAX_BODY_BYTES

    host, port = server.url.removeprefix("http://").split(":")
    before = server.metrics().get("kiln:request_rejected_total{status=413}", 0)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    connection.putrequest("POST", "/v1/completions")
    for header, value in (("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}"),
                          ("Content-Length", str(MAX_BODY_BYTES + 1))):
        connection.putheader(header, value)
    connection.endheaders()  # and no body: the answer must not wait for one
    response = connection.getresponse()
    body = json.loads(response.read())
    assert response.status == 413 and "at most 10,485,760 bytes" in body["error"]["message"]
    connection.close()
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    chunk = json.dumps({"model": MODEL, "prompt": "x " * (MAX_BODY_BYTES // 2 + 1000)}).encode()
    connection.request("POST", "/v1/completions", body=iter([chunk[:len(chunk) // 2], chunk[len(chunk) // 2:]]),
                       headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
                       encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413 and "more than that" in json.loads(response.read())["error"]["message"]
    connection.close()
    assert server.metrics()["kiln:request_rejected_total{status=413}"] - before == 2
    code, _, answer = server.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert code == 200, answer


def test_a_client_that_never_reads_is_aborted_and_closed_while_8_others_stream_on(serve_artifact, reference):
    """One client sends a long streamed request with logprobs (chunks of hundreds of bytes) through a
    socket with a small receive buffer and never reads. With small bounds, the server aborts its request
    once the stream buffer fills (its rows freed long before its 2,000 tokens) and closes the connection
    after the write timeout, while 8 clients beside it stream their answers, each as it is alone. The
    connection is gone from the server without the client reading a byte: what was buffered for it is
    dropped, not left waiting for a reader that never comes."""
    import os
    import socket

    server = Server(serve_artifact, "--max-batch-size", "16", "--threads", "2", "--stream-buffer", "8",
                    "--write-timeout", "3", "--send-buffer", "4096")

    def sockets() -> int:
        fds = Path(f"/proc/{server.process.pid}/fd")
        return sum(os.readlink(fd).startswith("socket:") for fd in fds.iterdir() if fd.exists())

    try:
        host, port = server.url.removeprefix("http://").split(":")
        idle = sockets()
        silent = socket.socket()
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        silent.connect((host, int(port)))
        body = json.dumps({"model": MODEL, "prompt": "The quick", "max_tokens": LONGEST, "temperature": 0,
                           "stream": True, "ignore_eos": True, "logprobs": 5}).encode()
        silent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        _wait_for(lambda: server.metrics()["kiln:num_requests_running"] == 1)

        prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(8)]
        expected = [reference.generate([p], SamplingParams(max_new_tokens=40, ignore_eos=True))[0].text
                    for p in prompts]

        async def one(client, prompt: str) -> str:
            pieces = []
            async for chunk in await client.completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                                               temperature=0, stream=True,
                                                               extra_body={"ignore_eos": True}):
                pieces.append(chunk.choices[0].text)
            return "".join(pieces)

        async def everyone() -> list[str]:
            async with server.client(asynchronous=True) as client:
                return await asyncio.gather(*(one(client, p) for p in prompts))

        assert asyncio.run(everyone()) == expected
        aborted = "kiln:request_success_total{finished_reason=abort}"
        _wait_for(lambda: server.metrics().get(aborted, 0) == 1, timeout=60)
        _wait_for(lambda: any("closed a stream whose client took no bytes for 3 s" in line
                              for line in server.lines), timeout=30)
        after = server.metrics()
        assert after["kiln:num_requests_running"] == 0
        assert after["kiln:generation_tokens_total"] - 8 * 40 < LONGEST  # aborted before its end
        _wait_for(lambda: sockets() <= idle, timeout=30)  # the silent client's socket is closed, unread
        # It was reset: reading ends in an error or at once, with no [DONE] among what came before.
        silent.settimeout(10)
        received = b""
        try:
            while chunk := silent.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
        assert b"data: [DONE]" not in received
        silent.close()
    finally:
        assert server.stop() == 0
    log = "".join(server.lines)
    assert "aborted a stream whose client left more than 8 tokens unread" in log
    assert "Traceback" not in log and "without completing response" not in log, log


def test_a_short_soak_adds_up(serve_artifact, tmp_path):
    """bench/soak.py for half a minute against the tiny artifact: the mix's statuses are the expected
    ones, no 5xx, the sequences and refusals the client saw are what /metrics counts, fds and threads
    are flat, and the silent client ends and is closed. (RSS and latency need the real model and
    minutes, not this: bench/soak.py's own run.)"""
    output = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "bench" / "soak.py"), "--artifact",
                           str(serve_artifact), "--variant", "cpu-fp32", "--minutes", "0.4", "--checkpoint-every", "12",
                           "--burst-every", "8", "--itl-rounds", "1", "--write-timeout", "3", "--output", str(output)],
                          capture_output=True, text=True, timeout=600)
    assert output.exists(), done.stdout + done.stderr
    result = json.loads(output.read_text())
    checks = {row["check"]: row for row in result["checks"]}
    for name, row in checks.items():
        if not name.startswith(("RSS", "8 streams' ITL")):
            assert row["pass"], (name, row["measured"], done.stdout[-3000:])
    assert {"200", "400", "404", "413", "429"} <= set(result["statuses"]), result["statuses"]
    assert result["server_exit"] == 0 and set(result["kinds"]) >= {"completion", "chat stream", "bad body"}
