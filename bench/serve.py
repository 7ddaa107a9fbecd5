"""Serving under load: `kiln serve` with N concurrent clients against the same prompts as static batches.

    python bench/serve.py [--artifact out/smollm2-135m-instruct] [--variants cpu-fp32 cpu-int8]
                          [--clients 1 8 32 64] [--new-tokens 64] [--threads 2]

For each variant: one `kiln serve` subprocess (--threads, max batch 32). For each level N, N clients
each send --rounds streamed /v1/completions requests back to back (at least 8 in all), client i
starting at i x (one static batch's time / N) so requests arrive as a stream, not one burst;
greedy, prompts of 30 to 60 tokens sent as token ids, exactly --new-tokens
generated (ignore_eos). Measured from the client side: requests/s, output tokens/s over the level's
wall time and over its steady state (every client started, none done; tokens counted by streamed
chunk), time to first token and inter-token latency (p50, p99). Beside it, with the server idle,
the same prompts through Generator in static batches of N (all prefilled at once, decoded together:
the batch is fixed before decoding, as before continuous batching). And one prefill: a single prompt
alone, batch 1, median over prompts, in process (the 1-client level is the same through HTTP).
The server and the static runs never overlap (2 cores).
Writes bench/results/serve.json and prints a table. Targets (issue 12): at 32 clients, steady output
tokens/s >= 90% of the static batch of 32, and p50 time to first token < 2 x one prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from generate import make_prompts  # noqa: E402


async def stream_completion(port: int, payload: dict) -> tuple[float, list[float], int]:
    """POST a streamed completion over a bare HTTP/1.1 connection (a light client: it shares the 2
    cores with the server). Returns (time to first token, token arrival times, tokens)."""
    body = json.dumps(payload).encode()
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"server answered {status!r}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    arrivals, tokens = [], 0
    buffer = b""
    while True:
        size_line = await reader.readline()  # chunked transfer encoding
        size = int(size_line.strip() or b"0", 16)
        if size == 0:
            break
        buffer += await reader.readexactly(size)
        await reader.readexactly(2)
        now = time.perf_counter()
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if event.startswith(b'data: {"id"') and b'"usage": {' in event:  # the last chunk: the count
                tokens = json.loads(event[6:])["usage"]["completion_tokens"]
            elif event.startswith(b"data: {"):  # a piece of text (a token's held-back bytes come later)
                arrivals.append(now)
    writer.close()
    return arrivals[0] - start, arrivals, tokens


async def run_level(port: int, model: str, prompts: list[list[int]], clients: int, new_tokens: int,
                    spacing: float) -> dict:
    """`clients` clients, each sending its share of `prompts` back to back; client i starts at i * spacing."""
    shares = [prompts[i::clients] for i in range(clients)]
    ttfts, gaps, tokens, arrivals = [], [], 0, []
    spans: list[tuple[float, float]] = []  # (first request sent, last answer done) per client

    async def client(index: int) -> None:
        nonlocal tokens
        await asyncio.sleep(spacing * index)
        begun = time.perf_counter()
        for prompt in shares[index]:
            payload = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True}
            ttft, times, count = await stream_completion(port, payload)
            ttfts.append(ttft)
            gaps.extend(b - a for a, b in zip(times, times[1:], strict=False))
            arrivals.extend(times)
            tokens += count
        spans.append((begun, time.perf_counter()))

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - start
    assert tokens == len(prompts) * new_tokens, (tokens, len(prompts) * new_tokens)
    # Steady state: every client has started and none has finished.
    steady_from, steady_to = max(b for b, _ in spans), min(e for _, e in spans)
    steady = sum(steady_from <= t < steady_to for t in arrivals) / (steady_to - steady_from) \
        if steady_to > steady_from + 1 else float("nan")
    return {"requests": len(prompts), "wall_s": wall, "requests_per_s": len(prompts) / wall,
            "output_tokens_per_s": tokens / wall, "steady_tokens_per_s": steady,
            "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
            "itl_p50_s": _pct(gaps, 50), "itl_p99_s": _pct(gaps, 99)}


def static_batches(generator, prompts: list[list[int]], batch: int, new_tokens: int) -> dict:
    from runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine = generator.engine
    engine.max_batch_size, engine.max_prefill_tokens = batch, batch * max(map(len, prompts))
    start, ttfts, batches = time.perf_counter(), [], []
    for first in range(0, len(prompts), batch):
        begun = time.perf_counter()
        results = generator.generate(prompts[first:first + batch], params)
        batches.append(time.perf_counter() - begun)
        ttfts += [r.time_to_first_token_s for r in results]
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens_per_s": len(prompts) * new_tokens / wall, "ttft_p50_s": _pct(ttfts, 50),
            "batch_s": statistics.median(batches)}


def one_prefill(generator, prompts: list[list[int]]) -> float:
    from runtime.sampling import SamplingParams

    times = [generator.generate([p], SamplingParams(max_new_tokens=1))[0].time_to_first_token_s for p in prompts]
    return statistics.median(times)


def start_server(artifact: Path, variant: str, threads: int, *extra: str) -> tuple[subprocess.Popen, int, str]:
    process = subprocess.Popen([sys.executable, "-m", "runtime.kiln_cli", "serve", str(artifact), "--variant", variant,
                                "--port", "0", "--threads", str(threads), "--max-batch-size", "32", *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    first = process.stdout.readline()
    match = re.search(r":(\d+)/v1  model (\S+)", first)
    if not match:
        raise SystemExit(f"kiln serve did not start: {first}{process.stdout.read()}")
    while "ready" not in (line := process.stdout.readline()):
        if not line:
            raise SystemExit("kiln serve exited while loading")
    return process, int(match.group(1)), match.group(2)


def _pct(values: list[float], q: int) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=ROOT / "out" / "smollm2-135m-instruct")
    parser.add_argument("--variants", nargs="+", default=["cpu-fp32", "cpu-int8"])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 8, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="Requests per client.")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results" / "serve.json")
    args = parser.parse_args()
    from runtime.generator import Generator

    rows = []
    for variant in args.variants:
        generator = Generator.load(args.artifact, variant, threads=args.threads)
        all_prompts = make_prompts(generator.tokenizer, args.rounds * max(args.clients))
        generator.warmup()
        prefill = one_prefill(generator, all_prompts[:16])
        idle_ttft = None  # the 1-client level's TTFT: one prefill through the whole HTTP path
        for clients in sorted(args.clients):
            prompts = all_prompts[:max(8, args.rounds * clients)]
            static = static_batches(generator, prompts, min(clients, 32), args.new_tokens)
            # Clients start spread over one static batch's time, so their requests arrive as a stream,
            # not as one burst (a burst of N prompts waits N prefills, however it is scheduled).
            spacing = static["batch_s"] / clients
            server, port, model = start_server(args.artifact, variant, args.threads)
            try:
                served = asyncio.run(run_level(port, model, prompts, clients, args.new_tokens, spacing))
            finally:
                server.terminate()
                server.wait(60)
            row = {"variant": variant, "clients": clients, **served, "static_batch": min(clients, 32),
                   "static_tokens_per_s": static["output_tokens_per_s"], "static_ttft_p50_s": static["ttft_p50_s"],
                   "one_prefill_s": prefill,
                   "throughput_vs_static": served["steady_tokens_per_s"] / static["output_tokens_per_s"],
                   "ttft_p50_vs_one_prefill": served["ttft_p50_s"] / prefill}
            idle_ttft = idle_ttft or (served["ttft_p50_s"] if clients == 1 else None)
            row["ttft_p50_vs_idle_server"] = served["ttft_p50_s"] / idle_ttft if idle_ttft else None
            rows.append(row)
            print(_line(row), flush=True)
        generator.backend.close()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"artifact": str(args.artifact), "threads": args.threads,
                                       "new_tokens": args.new_tokens, "rows": rows}, indent=2) + "\n")
    print("\n" + table(rows))


def _line(row: dict) -> str:
    return (f"{row['variant']} x{row['clients']}: {row['output_tokens_per_s']:.1f} tok/s "
            f"(static {row['static_tokens_per_s']:.1f}), ttft p50 {row['ttft_p50_s'] * 1e3:.0f} ms")


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def table(rows: list[dict]) -> str:
    head = ("| variant | clients | req/s | out tok/s (all / steady) | static batch tok/s | steady / static "
            "| TTFT p50 / p99 ms | ITL p50 / p99 ms | one prefill ms | TTFT p50 / prefill | TTFT p50 / 1-client |")
    lines = [head, "|" + " --- |" * 11]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['clients']} | {r['requests_per_s']:.2f} "
                     f"| {r['output_tokens_per_s']:.1f} / {r['steady_tokens_per_s']:.1f} "
                     f"| {r['static_tokens_per_s']:.1f} (b{r['static_batch']}) | {r['throughput_vs_static']:.2f} "
                     f"| {r['ttft_p50_s'] * 1e3:.0f} / {r['ttft_p99_s'] * 1e3:.0f} "
                     f"| {r['itl_p50_s'] * 1e3:.0f} / {r['itl_p99_s'] * 1e3:.0f} | {r['one_prefill_s'] * 1e3:.0f} "
                     f"| {r['ttft_p50_vs_one_prefill']:.2f} | {_ratio(r['ttft_p50_vs_idle_server'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
