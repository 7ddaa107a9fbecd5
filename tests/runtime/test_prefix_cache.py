"""The prefix cache (runtime/prefix_cache.py): prompts that begin alike reuse the KV of their common
blocks, and nothing changes in the answers: greedy tokens with the cache equal those without it (each
prompt alone, the cache off) for every family and both KV cache forms, in a burst, later, in mixed
batches and fed in pieces; hits are counted, and a small budget evicts least recently used blocks."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.generator import Generator
from runtime.prefix_cache import BLOCK_TOKENS, PrefixCache, block_keys
from runtime.sampling import SamplingParams

from .test_engine import VARIANTS, _run_staggered

PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


def _shared_prefix_prompts(count: int, prefix: int = 72, seed: int = 0) -> list[list[int]]:
    """`count` prompts: one `prefix`-token system prompt, then 1 to 24 tokens of their own."""
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(1, 300, prefix)]
    return [system + [int(t) for t in rng.integers(1, 300, int(rng.integers(1, 25)))] for _ in range(count)]


def _alone_without_cache(artifact, variant: str, prompts: list[list[int]]) -> list[list[int]]:
    reference = Generator.load(artifact, variant, prefix_cache_mib=0)
    assert reference.engine.scheduler.prefix_cache is None
    return [reference.generate([p], PARAMS)[0].token_ids for p in prompts]


@pytest.mark.parametrize("variant", VARIANTS)
def test_answers_with_the_cache_equal_those_without_in_a_burst_and_later(tiny_artifacts, family, variant):
    prompts = _shared_prefix_prompts(10, seed=len(family))
    expected = _alone_without_cache(tiny_artifacts[family], variant, prompts)
    generator = Generator.load(tiny_artifacts[family], variant)
    cache = generator.engine.scheduler.prefix_cache
    burst = generator.generate(prompts, PARAMS)  # one step's arrivals: the first prefilled, the rest reuse it
    assert [r.token_ids for r in burst] == expected
    shared = (72 // BLOCK_TOKENS) * BLOCK_TOKENS
    assert [r.cached_tokens for r in burst].count(0) == 1 and all(r.cached_tokens >= shared for r in burst
                                                                   if r.cached_tokens)
    assert cache.queries == sum(map(len, prompts)) and cache.hits == sum(r.cached_tokens for r in burst)
    later = generator.generate(prompts[::-1], PARAMS)  # every block cached now: all but the last token's block
    assert [r.token_ids for r in later] == expected[::-1]
    assert [r.cached_tokens for r in later] == [(len(p) - 1) // BLOCK_TOKENS * BLOCK_TOKENS for p in prompts[::-1]]


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_prompts_join_running_batches_and_are_fed_in_pieces(tiny_artifacts, variant):
    """A server's policy (decode steps between prefills), small prefill budgets (a cached prompt's rest fed
    in pieces), few rows (requests wait), arrivals spread over steps, prompts with and without the prefix."""
    prompts = _shared_prefix_prompts(12, prefix=80, seed=7) + _shared_prefix_prompts(4, prefix=3, seed=8)
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in np.random.default_rng(1).integers(
        1, 20, len(prompts))]
    reference = Generator.load(tiny_artifacts["llama"], variant, prefix_cache_mib=0)
    expected = [reference.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    for budget, batch in [(512, 16), (16, 5), (7, 3)]:
        engine = Generator.load(tiny_artifacts["llama"], variant).engine
        engine.max_prefill_tokens, engine.max_batch_size, engine.prefill_first = budget, batch, False
        arrivals = sorted(np.random.default_rng(budget).integers(0, 40, len(prompts)))
        results, _ = _run_staggered(engine, prompts, params, arrivals)
        assert [results[i].token_ids for i in range(len(prompts))] == expected, (budget, batch)
        assert engine.scheduler.prefix_cache.hits > 0


def test_forks_and_beams_start_from_a_cached_prefix(tiny_artifacts):
    prompts = _shared_prefix_prompts(3, seed=11)
    reference = Generator.load(tiny_artifacts["llama"], "cpu-fp32", prefix_cache_mib=0)
    generator = Generator.load(tiny_artifacts["llama"], "cpu-fp32")
    generator.generate(prompts[:1], PARAMS)  # the prefix is cached
    for params in (SamplingParams(max_new_tokens=8, n=3, temperature=1.0, seed=5),
                   SamplingParams(max_new_tokens=8, num_beams=3, n=2)):
        want = reference.generate(prompts[1:], params)
        got = generator.generate(prompts[1:], params)
        assert all(r.cached_tokens for r in got)
        for a, b in zip(want, got, strict=True):
            assert [a.token_ids] + [x.token_ids for x in a.alternatives] == \
                [b.token_ids] + [x.token_ids for x in b.alternatives]


def test_a_small_budget_evicts_least_recently_used_blocks_and_answers_stay_the_same(tiny_artifacts):
    artifact = tiny_artifacts["llama"]
    groups = [_shared_prefix_prompts(3, prefix=64, seed=20 + i) for i in range(4)]  # 4 system prompts
    expected = [_alone_without_cache(artifact, "cpu-fp32", group) for group in groups]
    probe = Generator.load(artifact, "cpu-fp32")
    probe.generate(groups[0][:1], PARAMS)
    probe_cache = probe.engine.scheduler.prefix_cache
    per_block = probe_cache.bytes // len(probe_cache.blocks)
    generator = Generator.load(artifact, "cpu-fp32", prefix_cache_mib=10 * per_block / 2**20)
    cache = generator.engine.scheduler.prefix_cache
    for group, want in zip(groups, expected, strict=True):
        assert [r.token_ids for r in generator.generate(group, PARAMS)] == want
        assert cache.bytes <= cache.budget_bytes
    assert cache.evicted_blocks > 0
    # The newest system prompt is still held, whole; the first one's blocks are gone.
    assert cache.usable(block_keys(groups[-1][0]), len(groups[-1][0])) == 4
    assert cache.usable(block_keys(groups[0][0]), len(groups[0][0])) == 0
    assert [r.token_ids for r in generator.generate(groups[0], PARAMS)] == expected[0]


def test_a_short_shared_header_keeps_a_bursts_prompts_prefilling_together(tiny_artifacts, monkeypatch):
    """Prompts that share 1 to 3 blocks (a chat template's fixed header) are prefilled as one group, as
    without the cache: waiting for so short a prefix would cost more than it saves (MIN_REUSE_BLOCKS)."""
    generator = Generator.load(tiny_artifacts["llama"], "cpu-fp32")
    prompts = _shared_prefix_prompts(6, prefix=40, seed=3)
    groups = []
    original = generator.engine.scheduler.admit

    def admit() -> bool:
        admitted = original()
        if admitted:
            groups.append(len(generator.engine.scheduler.prefill.requests))
        return admitted

    monkeypatch.setattr(generator.engine.scheduler, "admit", admit)
    results = generator.generate(prompts, PARAMS)
    assert groups == [6] and not any(r.cached_tokens for r in results)
    assert [r.token_ids for r in results] == _alone_without_cache(tiny_artifacts["llama"], "cpu-fp32", prompts)
    lone = generator.generate(prompts[:1], PARAMS)[0]  # alone, a request takes any hit
    assert lone.cached_tokens == (len(prompts[0]) - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def test_eviction_takes_a_chains_last_blocks_first():
    cache = PrefixCache(budget_bytes=4 * 256)  # 4 blocks of 4 arrays of 16 floats
    slots = lambda start, stop: [np.zeros((1, stop - start, 1), np.float32)] * 4  # noqa: E731
    first, second = block_keys(range(48)), block_keys(range(100, 132))
    cache.keep(first, slots)
    cache.keep(second, slots)  # 5 blocks > 4: the first chain's last block goes, not its first
    assert cache.evicted_blocks == 1 and cache.usable(first, 49) == 2 and cache.usable(second, 33) == 2
    assert cache.take(first, 49) is not None  # a hit makes the chain the most recent again, its first block last
    cache.keep(block_keys(range(200, 216)), slots)
    assert cache.usable(first, 49) == 2 and cache.usable(second, 33) == 1


def test_serve_counts_prefix_hits_in_metrics_and_answers_as_without_the_cache(serve_artifact):
    from .test_server import KEY, MODEL, Server

    system = "You label posts for a moderation queue. " * 12
    chats = [[{"role": "system", "content": system}, {"role": "user", "content": f"post number {i}"}]
             for i in range(6)]
    reference = Generator.load(serve_artifact, prefix_cache_mib=0, threads=2)
    want = [reference.generate([c], SamplingParams(max_new_tokens=8))[0].text for c in chats]
    server = Server(serve_artifact, "--api-key", KEY, "--threads", "2")
    try:
        client = server.client()
        answers = [client.chat.completions.create(model=MODEL, messages=c, max_tokens=8, temperature=0)
                   for c in chats[:-1]]
        chunks = list(client.chat.completions.create(model=MODEL, messages=chats[-1], max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        metrics = server.metrics()
    finally:
        assert server.stop() == 0
    got = [a.choices[0].message.content for a in answers] + ["".join(c.choices[0].delta.content or ""
                                                                     for c in chunks if c.choices)]
    assert got == want
    encoded = [reference.encode(c) for c in chats]
    assert metrics["kiln:prefix_cache_queries_total"] == sum(map(len, encoded))
    common = next(i for i, (a, b) in enumerate(zip(*encoded[:2], strict=False)) if a != b)
    assert common > 2 * BLOCK_TOKENS
    assert metrics["kiln:prefix_cache_hits_total"] >= 5 * (common // BLOCK_TOKENS) * BLOCK_TOKENS
    assert metrics["kiln:prefix_cache_bytes"] > 0
    # Each answer's usage says how many of its prompt tokens the cache gave, as OpenAI's API does.
    cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
    cached.append(chunks[-1].usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and all(c == (common // BLOCK_TOKENS) * BLOCK_TOKENS for c in cached[1:])
    assert sum(cached) == metrics["kiln:prefix_cache_hits_total"]


def test_serve_refuses_a_prefix_cache_that_leaves_no_room_in_one_line(serve_artifact):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "runtime.kiln_cli", "serve", str(serve_artifact), "--port", "0",
                           "--prefix-cache-mib", str(1 << 30)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--prefix-cache-mib" in done.stderr and "lower it" in done.stderr
