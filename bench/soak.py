"""Hours of serving: `kiln serve` on loopback under the mix a production server meets, for a bounded
time, with its resident memory, open file descriptors and threads sampled throughout.

    python bench/soak.py [--artifact out/smollm2-135m-instruct] [--variant cpu-int8] [--minutes 20]
                         [--max-requests 20000] [--clients 6] [--threads 2]

Two phases, each on a server of its own:

1. A silent client's cost to the others (max batch 16: room for the 8 and a 9th). 8 greedy streams of
   64 tokens, again and again while a 9th client's long stream with logprobs decodes: first a client
   that reads it, then one that never reads a byte (while it decodes, its buffers fill and its write
   is stuck, until the stream buffer aborts it); --itl-rounds times. Median inter-token latency of
   the 8 beside each, and their ratio (1.0: a silent client costs them no more than a reading one).
   Each silent client's request must end, by its stream buffer or its write timeout, whichever it
   meets first, and its connection be closed (the server's lines say which).
2. The soak (max batch 8, max queue 8, so bursts find the queue full). --clients clients send
   requests back to back until --minutes pass or --max-requests are sent, each request drawn
   (seeded) from: completions and chat, streamed or not; n > 1 sampled with a seed; beam search;
   stop strings; logprobs; a stream dropped after two chunks; a client that never reads; bad bodies
   (an unknown role, malformed JSON, an unknown model, max_tokens -1, a body over 10 MB). Every
   --burst-every seconds a burst of 3 x (batch + queue) requests at once. Every --checkpoint-every
   seconds the load pauses until the server is idle and its idle connections have expired, and
   RSS, fds and threads are sampled quiet (samples under load move with the load).

Checked (each a row of the table, the run's exit code 1 if one fails):
- no 5xx, and no error inside a 200 stream;
- no request without an answer (a timeout, a connection dropped);
- nothing lost: the sequences the server admitted (every 200's n x prompts) equal the sequences
  /metrics counts finished (stop, length) or aborted, and every refusal the client saw is counted
  under its status in kiln:request_rejected, so requests sent = finished + aborted + rejected;
- RSS flat after warm-up: the last quiet sample at most 5% over the first quiet sample after the
  first quarter of the run; open fds and threads quiet no higher at the end than then.
Writes bench/results/soak.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SILENT_TOKENS = 1900  # a silent client's request: long enough to fill every buffer on the way
QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Name three prime numbers.",
             "Explain a KV cache in one sentence.", "What is 12 times 12?", "Give me a word that rhymes with cat.",
             "Why is the sky blue?", "List two colours of the rainbow."]


@dataclass
class Tally:
    """What the clients saw."""

    sent: int = 0
    statuses: Counter = field(default_factory=Counter)  # HTTP status -> requests
    admitted_sequences: int = 0  # n x prompts of every 200
    finishes: Counter = field(default_factory=Counter)  # finish reasons the client read
    kinds: Counter = field(default_factory=Counter)
    stream_errors: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # no answer at all: a timeout, a connection dropped
    unexpected: list[str] = field(default_factory=list)  # a status other than the kind's expected one


class ServerProcess:
    def __init__(self, artifact: Path, variant: str, threads: int, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "runtime.kiln_cli", "serve", str(artifact), "--variant", variant, "--host",
             "127.0.0.1", "--port", "0", "--threads", str(threads), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        first = self.process.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/v1\s+model (\S+)", first)
        if not match:
            raise SystemExit(f"kiln serve did not start: {first}{self.process.stdout.read()}")
        self.port, self.model = int(match.group(1)), match.group(2)
        self.lines = [first]
        threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True).start()
        deadline = time.time() + 300
        while not self._healthy():
            if time.time() > deadline or self.process.poll() is not None:
                raise SystemExit("kiln serve did not become ready:\n" + "".join(self.lines))
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as answer:
            text = answer.read().decode()
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return values

    def resources(self) -> dict[str, float]:
        proc = Path(f"/proc/{self.process.pid}")
        status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
        return {"t": time.time(), "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
                "threads": int(status["Threads"]), "fds": len(os.listdir(proc / "fd"))}

    def closed_for_silence(self) -> int:
        return sum("closed a stream whose client took no bytes" in line for line in self.lines)

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(120)


# -- raw HTTP, for what the openai client cannot do (drop a stream, never read, send a broken body) --

def _request_bytes(port: int, path: str, body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode() + body


async def raw_post(port: int, path: str, body: bytes, content_length: int | None = None) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_request_bytes(port, path, body, content_length))
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    return _status(data), data


def _status(line: bytes) -> int:
    """The status of an HTTP/1.1 status line; 0 for anything else (a connection closed early)."""
    parts = line.split(b" ", 2)
    return int(parts[1]) if line.startswith(b"HTTP/1.1 ") and len(parts) > 1 and parts[1].isdigit() else 0


async def dropped_stream(port: int, model: str, question: str) -> int:
    """A streamed completion the client drops after two chunks; returns the status."""
    body = json.dumps({"model": model, "prompt": question, "max_tokens": 400, "stream": True,
                       "ignore_eos": True, "temperature": 0}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_request_bytes(port, "/v1/completions", body))
        await writer.drain()
        status = _status(await reader.readline())
        chunks = 0
        while status == 200 and chunks < 2:
            line = await reader.readline()
            if not line:
                break
            chunks += line.startswith(b"data: ")
    finally:
        writer.close()
    return status


def silent_client(server: ServerProcess, limit_s: float = 300) -> int:
    """A long stream with logprobs (chunks of hundreds of bytes) through a small receive buffer, never
    read (its status line only peeked at: a refusal ends it); the socket is held until the server says
    it closed a silent stream, or limit_s passed. Returns the status."""
    port = server.port
    closed_before = server.closed_for_silence()
    body = _long_request(server.model)
    with socket.socket() as silent:
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        silent.connect(("127.0.0.1", port))
        silent.sendall(_request_bytes(port, "/v1/completions", body))
        silent.settimeout(120)
        status = _status(silent.recv(12, socket.MSG_PEEK | socket.MSG_WAITALL))
        if status != 200:
            return status
        deadline = time.time() + limit_s
        while server.closed_for_silence() == closed_before and time.time() < deadline:
            time.sleep(0.2)
    return 200


def reading_client(server: ServerProcess) -> None:
    """The silent client's request, read to its end as it comes."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=300) as reader:
        reader.sendall(_request_bytes(server.port, "/v1/completions", _long_request(server.model)))
        while reader.recv(65536):
            pass


def _long_request(model: str) -> bytes:
    return json.dumps({"model": model, "prompt": "Count to a thousand.", "max_tokens": SILENT_TOKENS,
                       "stream": True, "ignore_eos": True, "logprobs": 5, "temperature": 0}).encode()


BAD_BODIES = [  # (what, body or None for an over-limit Content-Length, the status OpenAI's API gives)
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}, 400),
    ("malformed JSON", b'{"messages": [', 400),
    ("unknown model", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("max_tokens -1", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400),
    ("body over 10 MB", None, 413),
]


async def bad_body(port: int, model: str, index: int) -> tuple[int, int]:
    _, body, expected = BAD_BODIES[index % len(BAD_BODIES)]
    if body is None:  # the Content-Length alone says it; the body is never sent
        status, _ = await raw_post(port, "/v1/chat/completions", b"", content_length=11 * 2**20)
    else:
        payload = body if isinstance(body, bytes) else json.dumps({"model": model, **body}).encode()
        status, _ = await raw_post(port, "/v1/chat/completions", payload)
    return status, expected


# -- the mix ---------------------------------------------------------------------------------------

KINDS = {"completion": 14, "chat stream": 16, "n=3 sampled": 8, "beam search": 4, "stop strings": 8,
         "logprobs": 8, "dropped stream": 6, "silent": 1, "bad body": 8}


async def one_request(client, server: ServerProcess, kind: str, rng: random.Random, tally: Tally) -> None:
    import openai

    model, port = server.model, server.port
    question = rng.choice(QUESTIONS)
    messages = [{"role": "user", "content": question}]
    max_tokens = rng.randint(8, 48)
    tally.sent += 1
    tally.kinds[kind] += 1
    try:
        if kind == "dropped stream":
            status = await dropped_stream(port, model, question)
            _admitted(tally, status, 1)
            return
        if kind == "silent":
            status = await asyncio.to_thread(silent_client, server)
            _admitted(tally, status, 1)  # its answer is never read: the server counts it finished or aborted
            return
        if kind == "bad body":
            status, expected = await bad_body(port, model, tally.kinds[kind])
            tally.statuses[status] += 1
            if status != expected:
                tally.unexpected.append(f"{kind}: {status}, expected {expected}")
            return
        if kind == "completion":
            answer = await client.completions.create(model=model, prompt=question, max_tokens=max_tokens,
                                                     temperature=0)
            _answered(tally, answer.choices, 1)
        elif kind == "chat stream":
            finishes = []
            async for chunk in await client.chat.completions.create(
                    model=model, messages=messages, max_tokens=max_tokens, stream=True,
                    stream_options={"include_usage": True}):
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
            _answered_reasons(tally, finishes, 1)
        elif kind == "n=3 sampled":
            answer = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                          n=3, temperature=0.8, seed=rng.randint(0, 999))
            _answered(tally, answer.choices, 3)
        elif kind == "beam search":
            answer = await client.completions.create(model=model, prompt=question, max_tokens=12, n=2, best_of=3,
                                                     extra_body={"use_beam_search": True})
            _answered(tally, answer.choices, 2)
        elif kind == "stop strings":
            finishes = []
            async for chunk in await client.completions.create(model=model, prompt=question, max_tokens=48,
                                                               stream=True, stop=[".", "\n"], temperature=0):
                finishes += [c.finish_reason for c in chunk.choices if c.finish_reason]
            _answered_reasons(tally, finishes, 1)
        elif kind == "logprobs":
            answer = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                          logprobs=True, top_logprobs=3, temperature=0)
            _answered(tally, answer.choices, 1)
        else:
            raise ValueError(kind)
    except openai.APIStatusError as error:
        tally.statuses[error.status_code] += 1
        if error.status_code != 429:
            tally.unexpected.append(f"{kind}: {error.status_code} {error.message[:120]}")
    except openai.APIConnectionError as error:  # a timeout too: the request got no answer
        tally.lost.append(f"{kind}: {type(error).__name__}: {error}"[:200])
    except openai.APIError as error:  # an error event inside a 200 stream
        tally.statuses[200] += 1
        tally.stream_errors.append(f"{kind}: {error}"[:200])


def _admitted(tally: Tally, status: int, sequences: int) -> None:
    tally.statuses[status] += 1
    if status == 200:
        tally.admitted_sequences += sequences


def _answered(tally: Tally, choices: list, sequences: int) -> None:
    _answered_reasons(tally, [c.finish_reason for c in choices], sequences)


def _answered_reasons(tally: Tally, finishes: list[str], sequences: int) -> None:
    _admitted(tally, 200, sequences)
    tally.finishes.update(finishes)
    if len(finishes) != sequences:
        tally.unexpected.append(f"{sequences} sequences answered with {len(finishes)} finish reasons")


async def soak(server: ServerProcess, args: argparse.Namespace, tally: Tally, quiet: list[dict]) -> None:
    import openai

    rng = random.Random(0)
    kinds, weights = zip(*KINDS.items(), strict=True)
    started = time.time()
    end = started + args.minutes * 60
    go = asyncio.Event()
    go.set()
    in_flight = 0

    def more() -> bool:
        return time.time() < end and tally.sent < args.max_requests

    async def request(client, kind: str) -> None:
        nonlocal in_flight
        in_flight += 1
        try:
            await one_request(client, server, kind, rng, tally)
        finally:
            in_flight -= 1

    async def worker(client) -> None:
        while more():
            await go.wait()
            await request(client, rng.choices(kinds, weights)[0])

    async def bursts(client) -> None:
        while more():
            await asyncio.sleep(args.burst_every)
            await go.wait()
            if more():
                await asyncio.gather(*(request(client, "completion") for _ in range(3 * (8 + 8))))

    async def checkpoints() -> None:
        while more():
            await asyncio.sleep(min(args.checkpoint_every, max(0.0, end - time.time())))
            go.clear()
            while in_flight:
                await asyncio.sleep(0.1)
            await quiet_sample(server, quiet, started)
            go.set()

    async with openai.AsyncOpenAI(api_key="unused", base_url=f"http://127.0.0.1:{server.port}/v1",
                                  max_retries=0, timeout=300) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.clients)), bursts(client), checkpoints())
    await quiet_sample(server, quiet, started)


async def quiet_sample(server: ServerProcess, quiet: list[dict], started: float) -> None:
    """Once the server is idle (nothing running or waiting), and its idle keep-alive connections and
    the silent clients' have closed, one sample."""
    deadline = time.time() + 120
    while time.time() < deadline:
        values = await asyncio.to_thread(server.metrics)
        if not values["kiln:num_requests_running"] and not values["kiln:num_requests_waiting"]:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(7)  # uvicorn's and httpx's keep-alive of 5 s
    sample = server.resources()
    sample["minute"] = (sample["t"] - started) / 60
    quiet.append(sample)
    print(f"  quiet at {sample['minute']:.1f} min: RSS {sample['rss_mib']:.1f} MiB, {sample['fds']} fds, "
          f"{sample['threads']} threads, {tally_line(server)}", flush=True)


def tally_line(server: ServerProcess) -> str:
    values = server.metrics()
    finished = sum(v for k, v in values.items() if k.startswith("kiln:request_success_total"))
    rejected = sum(v for k, v in values.items() if k.startswith("kiln:request_rejected_total"))
    return f"{finished:.0f} sequences finished, {rejected:.0f} requests refused"


# -- phase 1: inter-token latency beside a silent client -------------------------------------------

async def itl_of_eight(server: ServerProcess) -> list[float]:
    """8 greedy streams of 64 tokens at once; every gap between two chunks of a stream."""
    import openai

    async def one(client, index: int) -> list[float]:
        arrivals = []
        async for chunk in await client.completions.create(model=server.model, prompt=QUESTIONS[index],
                                                           max_tokens=64, temperature=0, stream=True,
                                                           extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter())
        return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]

    async with openai.AsyncOpenAI(api_key="unused", base_url=f"http://127.0.0.1:{server.port}/v1",
                                  max_retries=0, timeout=300) as client:
        gaps = await asyncio.gather(*(one(client, i) for i in range(8)))
    return [g for stream in gaps for g in stream]


def silent_client_cost(server: ServerProcess, rounds: int) -> dict:
    """Per round, the 8 streams again and again beside a 9th client's long request while it decodes:
    first a client that reads it, then one that never does (until the stream buffer aborts it). Both
    are a 9th row in every step; what differs is only whether its client reads."""
    beside_reader, beside_silent = [], []
    for _ in range(rounds):
        for client, gaps in ((reading_client, beside_reader), (silent_client, beside_silent)):
            aborted_before = _stream_buffer_aborts(server)
            ninth = threading.Thread(target=client, args=(server,))
            ninth.start()
            deadline = time.time() + 60  # until it runs
            while not server.metrics()["kiln:num_requests_running"] and time.time() < deadline:
                time.sleep(0.05)
            gaps += asyncio.run(itl_of_eight(server))
            while ninth.is_alive() and _stream_buffer_aborts(server) == aborted_before:
                gaps += asyncio.run(itl_of_eight(server))
            ninth.join()
    result = {"rounds": rounds, "itl_p50_beside_reader_s": statistics.median(beside_reader),
              "itl_p50_beside_silent_s": statistics.median(beside_silent), "silent_clients": rounds,
              "silent_aborted": _stream_buffer_aborts(server), "silent_connections_closed": server.closed_for_silence()}
    result["itl_ratio"] = result["itl_p50_beside_silent_s"] / result["itl_p50_beside_reader_s"]
    return result


def _stream_buffer_aborts(server: ServerProcess) -> int:
    return sum("aborted a stream whose client left" in line for line in server.lines)


# -- the checks and the table ----------------------------------------------------------------------

def verdicts(tally: Tally, metrics: dict[str, float], quiet: list[dict], slow: dict, warmup_minute: float) -> list:
    def metric(prefix: str) -> dict[str, float]:
        return {re.search(r"=(\w+)\}", k).group(1): v for k, v in metrics.items() if k.startswith(prefix)}

    finished = metric("kiln:request_success_total")
    rejected = {int(k): v for k, v in metric("kiln:request_rejected_total").items()}
    fives = sum(v for s, v in tally.statuses.items() if s >= 500) + sum(v for s, v in rejected.items() if s >= 500)
    client_refusals = {s: v for s, v in tally.statuses.items() if s != 200}
    admitted_requests = tally.statuses.get(200, 0)
    after = [s for s in quiet if s["minute"] >= warmup_minute] or quiet[-1:]
    first, last = after[0], quiet[-1]
    rss_growth = last["rss_mib"] / first["rss_mib"] - 1
    rows = [
        ("no 5xx", f"{fives:.0f} 5xx, {len(tally.stream_errors)} errors in 200 streams, "
                   f"{finished.get('error', 0):.0f} sequences failed",
         fives == 0 and not tally.stream_errors and not finished.get("error")),
        ("every status as expected", f"{len(tally.unexpected)} unexpected" +
         (f" (first: {tally.unexpected[0]})" if tally.unexpected else ""), not tally.unexpected),
        ("sequences: admitted = finished + aborted",
         f"{tally.admitted_sequences} admitted, /metrics: "
         + ", ".join(f"{k} {v:.0f}" for k, v in sorted(finished.items())),
         tally.admitted_sequences == sum(finished.values())),
        ("finishes the clients read <= /metrics",
         f"stop {tally.finishes['stop']}, length {tally.finishes['length']}",
         tally.finishes["stop"] <= finished.get("stop", 0) and tally.finishes["length"] <= finished.get("length", 0)),
        ("refusals: client = /metrics, by status",
         ", ".join(f"{s}: {v} / {rejected.get(s, 0):.0f}" for s, v in sorted(client_refusals.items())),
         {s: float(v) for s, v in client_refusals.items()} == {s: v for s, v in rejected.items() if v}),
        ("no request without an answer", f"{tally.sent} sent = {admitted_requests} answered + "
         f"{sum(client_refusals.values())} refused + {len(tally.lost)} with no answer"
         + (f" (first: {tally.lost[0]})" if tally.lost else ""),
         not tally.lost and tally.sent == admitted_requests + sum(client_refusals.values())),
        ("RSS flat after warm-up (<= 5%)", f"{first['rss_mib']:.1f} MiB at {first['minute']:.1f} min -> "
         f"{last['rss_mib']:.1f} MiB at {last['minute']:.1f} min ({rss_growth:+.1%})", rss_growth <= 0.05),
        ("open fds flat", f"{first['fds']} -> {last['fds']}", last["fds"] <= first["fds"]),
        ("threads flat", f"{first['threads']} -> {last['threads']}", last["threads"] <= first["threads"]),
        # Whichever bound a silent client meets first ends its request: the stream buffer (after
        # stream_buffer tokens behind a stuck write) or the write timeout, which closes it anyway.
        ("silent clients ended and closed", f"{slow['silent_connections_closed']} of {slow['silent_clients']} "
         f"closed, {slow['silent_aborted']:.0f} of them aborted by the stream buffer first",
         slow["silent_connections_closed"] == slow["silent_clients"]),
        ("8 streams' ITL: a 9th client silent / reading", f"p50 {slow['itl_p50_beside_reader_s'] * 1e3:.1f} ms "
         f"beside a reading one, {slow['itl_p50_beside_silent_s'] * 1e3:.1f} ms beside a silent one "
         f"({slow['itl_ratio']:.2f}x)", slow["itl_ratio"] <= 1.2),
    ]
    return [{"check": name, "measured": measured, "pass": bool(ok)} for name, measured, ok in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=ROOT / "out" / "smollm2-135m-instruct")
    parser.add_argument("--variant", default="cpu-int8")
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--max-requests", type=int, default=20000)
    parser.add_argument("--clients", type=int, default=6, help="Clients sending back to back.")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--burst-every", type=float, default=60.0)
    parser.add_argument("--checkpoint-every", type=float, default=120.0)
    parser.add_argument("--write-timeout", type=float, default=10.0)
    parser.add_argument("--itl-rounds", type=int, default=3)
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "soak.json")
    args = parser.parse_args()

    print(f"phase 1: 8 streams alone and beside a silent client, {args.itl_rounds} rounds", flush=True)
    rows_for_nine = ServerProcess(args.artifact, args.variant, args.threads, "--max-batch-size", "16",
                                  "--write-timeout", str(args.write_timeout))
    try:
        slow = silent_client_cost(rows_for_nine, args.itl_rounds)
    finally:
        rows_for_nine.stop()
    server = ServerProcess(args.artifact, args.variant, args.threads, "--max-batch-size", "8", "--max-queue", "8",
                           "--write-timeout", str(args.write_timeout))
    samples: list[dict] = []
    sampling = threading.Event()

    def sampler() -> None:
        while not sampling.wait(5):
            samples.append(server.resources())

    threading.Thread(target=sampler, daemon=True).start()
    started = time.time()
    try:
        print(f"phase 2: the mix for {args.minutes:g} min, {args.clients} clients", flush=True)
        tally, quiet = Tally(), []
        asyncio.run(soak(server, args, tally, quiet))
        rows = verdicts(tally, server.metrics(), quiet, slow, warmup_minute=args.minutes / 4)
    finally:
        sampling.set()
        code = server.stop()
    closed = server.closed_for_silence()
    result = {"artifact": str(args.artifact), "variant": args.variant, "minutes": args.minutes,
              "wall_minutes": (time.time() - started) / 60, "requests": tally.sent, "kinds": dict(tally.kinds),
              "statuses": {str(k): v for k, v in sorted(tally.statuses.items())}, "server_exit": code,
              "connections_closed_for_silence": closed, "silent_client_cost": slow, "checks": rows,
              "quiet_samples": quiet, "samples": samples, "unexpected": tally.unexpected[:20],
              "stream_errors": tally.stream_errors[:20], "lost": tally.lost[:20]}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{tally.sent} requests in {args.minutes:g} min ({', '.join(f'{k} {v}' for k, v in tally.kinds.items())})")
    print(f"statuses: {', '.join(f'{k}: {v}' for k, v in sorted(tally.statuses.items()))}; server exit {code}")
    if samples:
        print(f"RSS under load {min(s['rss_mib'] for s in samples):.1f}-{max(s['rss_mib'] for s in samples):.1f} MiB, "
              f"fds {min(s['fds'] for s in samples)}-{max(s['fds'] for s in samples)}, "
              f"threads {min(s['threads'] for s in samples)}-{max(s['threads'] for s in samples)}")
    width = max(len(r["check"]) for r in rows)
    print(f"\n{'check':<{width}}  pass  measured")
    for row in rows:
        print(f"{row['check']:<{width}}  {'yes' if row['pass'] else 'NO':<4}  {row['measured']}")
    sys.exit(0 if all(r["pass"] for r in rows) and code == 0 else 1)


if __name__ == "__main__":
    main()
