"""The step-level engine: rows joining and leaving between steps, on both KV cache forms."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine import RequestError
from runtime.generator import Generator
from runtime.sampling import SamplingParams

VARIANTS = ["cpu-fp32", "cpu-fp32-unfused"]  # GroupQueryAttention over shared buffers, and the plain graph


def _requests(count: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(1, 300, int(rng.integers(1, 40)))] for _ in range(count)]
    params = [SamplingParams(max_new_tokens=int(rng.integers(1, 24)), ignore_eos=bool(i % 2)) for i in range(count)]
    return prompts, params


def _run_staggered(engine, prompts, params, arrivals) -> tuple[dict, list[int]]:
    """Add request i at step arrivals[i]; returns each request's tokens and the batch's width per step."""
    results, widths, step, added = {}, [], 0, 0
    while added < len(prompts) or engine.has_work():
        while added < len(prompts) and arrivals[added] <= step:
            engine.add_request(prompts[added], params[added], request_id=added)
            added += 1
        for event in engine.step():
            if event.result is not None:
                results[event.request_id] = event.result
        widths.append(engine.running.width if engine.running else 0)
        step += 1
    return results, widths


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("budget, batch", [(512, 32), (16, 6), (7, 3)])
def test_staggered_arrivals_get_the_tokens_they_get_alone(tiny_artifacts, family, variant, budget, batch):
    generator = Generator.load(tiny_artifacts[family], variant)
    prompts, params = _requests(16, seed=len(family))
    alone = [generator.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    engine = generator.engine
    # A small prefill budget feeds long prompts in pieces; a small batch makes requests wait for rows.
    # A server's policy: decode steps between the pieces and between prefill groups.
    engine.max_prefill_tokens, engine.max_batch_size, engine.prefill_first = budget, batch, False
    arrivals = sorted(np.random.default_rng(budget).integers(0, 30, len(prompts)))
    results, _ = _run_staggered(engine, prompts, params, arrivals)
    assert [results[i].token_ids for i in range(len(prompts))] == alone
    assert all(results[i].finish_reason in ("eos", "length") for i in range(len(prompts)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_free_rows_are_reused_padding_dropped_and_idle_rows_compacted(tiny_artifacts, variant):
    engine = Generator.load(tiny_artifacts["llama"], variant).engine
    engine.max_batch_size = 2
    long_prompt, short = list(range(1, 61)), [5, 6, 7]
    engine.add_request(long_prompt, SamplingParams(max_new_tokens=2, ignore_eos=True), request_id="long")
    engine.add_request(short, SamplingParams(max_new_tokens=40, ignore_eos=True), request_id="short")
    engine.add_request(short, SamplingParams(max_new_tokens=30, ignore_eos=True), request_id="joiner")
    while "long" not in {e.request_id for e in engine.step() if e.finish_reason}:
        pass
    assert engine.running.width >= 61 and engine.running.free_rows() == [0]
    engine.step()  # the joiner's prefill: it takes the free row, the batch keeps its two rows
    assert len(engine.running.rows) == 2 and engine.running.free_rows() == []
    for _ in range(3):
        engine.step()
    # The long prompt's columns are padding in every row now: dropped, the batch is as wide as its longest row.
    assert engine.running.width == int(engine.running.lengths.max()) < 20
    while "joiner" not in {e.request_id for e in engine.step() if e.finish_reason}:
        pass
    # Nobody waits for the joiner's row and "short" has steps to go: the free row is compacted away.
    assert len(engine.running.rows) == 1
    while engine.has_work():
        engine.step()
    assert engine.running is None  # idle: the cache is let go


def _counted_copies(backend, monkeypatch) -> dict[str, list[int]]:
    """What the backend copies of caches from now on: "grown", the rows of each keep_rows that added
    rows; "copies", a 1 for each keep_rows that made new memory; "written", the rows of each write_rows."""
    seen: dict[str, list[int]] = {"grown": [], "copies": [], "written": []}
    keep_rows, write_rows = backend.keep_rows, backend.write_rows

    def counted_keeps(cache, rows, *rest):
        if len(rows) > cache.batch:
            seen["grown"].append(len(rows))
        kept = keep_rows(cache, rows, *rest)
        seen["copies"].extend([1] * (kept is not cache))
        return kept

    def counted_writes(cache, rows, *rest):
        seen["written"].append(len(rows))
        return write_rows(cache, rows, *rest)

    monkeypatch.setattr(backend, "keep_rows", counted_keeps)
    monkeypatch.setattr(backend, "write_rows", counted_writes)
    return seen


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_burst_that_prefills_in_several_steps_grows_the_batch_once(tiny_artifacts, variant, monkeypatch):
    """Requests that arrive together but prefill a few at a time (the prefill budget) join a batch grown
    once, with rows for those still waiting: one copy of the cache, not one per join. Where rows run
    apart (front-aligned shared buffers) the first group's batch has those rows from the start and each
    group is prefilled straight into its free rows: no copy at all. Later, wider prompts need columns in
    front: in shared buffers with room for them, no copy either."""
    # Without the prefix cache: the runs alone would leave these prompts' blocks cached, and a hit is a
    # group of its own (tests/runtime/test_prefix_cache.py), another pattern of copies.
    generator = Generator.load(tiny_artifacts["llama"], variant, max_batch_size=8, prefix_cache_mib=0)
    prompts = [[5 + i] * (12 + i) for i in range(8)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    alone = [generator.generate([p], params)[0].token_ids for p in prompts]
    backend, engine = generator.backend, generator.engine
    engine.max_prefill_tokens = 40  # two prompts a prefill step
    seen = _counted_copies(backend, monkeypatch)
    assert [r.token_ids for r in generator.generate(prompts, params)] == alone
    if backend.front_aligned:
        assert backend.limits.rows_in_place
        assert seen == {"grown": [], "copies": [], "written": []}
    else:
        assert seen["grown"] == [8] and len(seen["written"]) == 3  # the first group is the batch as it is


def test_a_bulk_call_prefills_every_prompt_before_it_decodes(tiny_artifacts, monkeypatch):
    """generate() prefills a burst's groups back to back (prefill_first); a server's engine runs a
    decode step once a group has spent the prefill budget. The tokens are the same either way."""
    generator = Generator.load(tiny_artifacts["llama"], "cpu-fp32", max_batch_size=8)
    prompts = [[5 + i] * (12 + i) for i in range(8)]
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    generator.engine.max_prefill_tokens = 40  # two prompts a prefill step
    widths, run = [], generator.backend.run
    monkeypatch.setattr(generator.backend, "run", lambda ids, *rest: widths.append(ids.shape[1]) or run(ids, *rest))
    bulk = [r.token_ids for r in generator.generate(prompts, params)]
    assert len(widths) == 4 + 3 and min(widths[:4]) > 1 and widths[4:] == [1, 1, 1]
    widths.clear()
    generator.engine.prefill_first = False
    assert [r.token_ids for r in generator.generate(prompts, params)] == bulk
    assert widths[:3] == [widths[0], widths[1], 1] and len(widths) > 7  # a decode step after the budget


def test_a_joiner_is_prefilled_into_a_free_row_in_place(tiny_artifacts, monkeypatch):
    """Where rows run apart, a prompt goes straight into a free row of the running batch, here one a
    request left at its first token, and wider than the batch: no row is copied, the batch keeps its
    memory, and every request gets the tokens it gets alone."""
    generator = Generator.load(tiny_artifacts["llama"], "cpu-fp32")
    params, once = SamplingParams(max_new_tokens=10, ignore_eos=True), SamplingParams(max_new_tokens=1)
    first, joiner = [9, 8, 7, 6, 5], list(range(20, 32))
    alone = [generator.generate([p], params)[0].token_ids for p in (first, joiner)]
    backend, engine = generator.backend, generator.engine
    seen = _counted_copies(backend, monkeypatch)
    engine.add_request(first, params, request_id="first")
    engine.add_request([3, 4], once, request_id="once")
    results = {e.request_id: e.result for e in engine.step() if e.result}
    assert list(results) == ["once"] and [row is None for row in engine.running.rows] == [False, True]
    memory = engine.running.cache[0]
    engine.add_request(joiner, params, request_id="joiner")
    engine.step()
    assert engine.running.rows[1].request.id == "joiner" and engine.running.width >= len(joiner)
    assert engine.running.cache[0] is memory
    while engine.has_work():
        results.update({e.request_id: e.result for e in engine.step() if e.result})
    assert [results["first"].token_ids, results["joiner"].token_ids] == alone
    assert seen["copies"] == [] and seen["written"] == []


def test_n_sequences_fork_from_one_prefill(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["qwen2"])
    greedy = generator.generate(["The quick brown"], SamplingParams(max_new_tokens=8, n=3, ignore_eos=True))[0]
    assert len(greedy.alternatives) == 2
    assert greedy.token_ids == greedy.alternatives[0].token_ids == greedy.alternatives[1].token_ids
    sampled = SamplingParams(max_new_tokens=8, temperature=1.5, seed=7, ignore_eos=True)
    forked = generator.generate(["The quick brown"], SamplingParams(**{**vars(sampled), "n": 3}))[0]
    single = generator.generate(["The quick brown"], sampled)[0]
    assert forked.token_ids == single.token_ids  # sequence 0 draws as the request would alone
    assert len({tuple(r.token_ids) for r in [forked, *forked.alternatives]}) == 3
    with pytest.raises(RequestError, match="n is 40; this engine runs at most 32"):
        generator.engine.add_request("hi", SamplingParams(n=40))


def test_logprobs_are_eager_torchs_log_softmax(tiny_artifacts, tiny_checkpoints):
    """Each token's logprob and the top ones against transformers' eager model and torch.log_softmax, an
    independent reference for the graph and for the engine's own log_softmax."""
    import torch
    from transformers import AutoModelForCausalLM

    generator = Generator.load(tiny_artifacts["llama"], "cpu-fp32-unfused")
    ids = generator.encode("The quick brown")
    result = generator.generate([ids], SamplingParams(max_new_tokens=3, logprobs=4, ignore_eos=True))[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"], attn_implementation="eager").eval()
    with torch.inference_mode():
        eager = model(torch.tensor([ids + result.token_ids[:1]])).logits[0].float()
    expected = torch.log_softmax(eager[-2], -1).numpy()
    assert result.logprobs[1].logprob == pytest.approx(
        float(torch.log_softmax(eager[-1], -1)[result.token_ids[1]]), abs=1e-4)
    first = result.logprobs[0]
    assert first.token_id == result.token_ids[0] == int(np.argmax(expected))
    assert first.logprob == pytest.approx(expected[first.token_id], abs=1e-4)
    assert [t for t, _ in first.top] == list(np.argsort(-expected)[:4])
    assert [lp for _, lp in first.top] == pytest.approx(sorted(expected, reverse=True)[:4], abs=1e-4)
    assert len(result.logprobs) == 3 and all(len(t.top) == 4 for t in result.logprobs)


def test_stop_token_ids_and_min_tokens(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["gpt2"])
    free = generator.generate(["The quick"], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    stop_token = free.token_ids[3]
    first = free.token_ids.index(stop_token)
    stopped = generator.generate(["The quick"], SamplingParams(max_new_tokens=12, stop_token_ids=(stop_token,)))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1]
    # min_tokens: the stop token is masked out until then, so the sequence runs past it.
    later = generator.generate(["The quick"], SamplingParams(max_new_tokens=12, stop_token_ids=(stop_token,),
                                                            min_tokens=first + 2))[0]
    assert stop_token not in later.token_ids[:first + 2] and len(later.token_ids) >= first + 2
    eos = generator.eos_ids
    forced = generator.generate(["The quick"], SamplingParams(max_new_tokens=10, min_tokens=10))[0]
    assert forced.generated_tokens == 10 and not eos & set(forced.token_ids)


def test_streamed_text_holds_back_a_possible_stop_string(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["gpt2"])
    free = generator.generate(["The quick"], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    stop = free.text[len(free.text) // 2: len(free.text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    pieces, final = [], None
    for event in generator.stream(["The quick"], SamplingParams(max_new_tokens=20, stop=(stop,), ignore_eos=True)):
        pieces.append(event.text)
        final = event.result or final
    assert final.finish_reason == "stop" and final.text == free.text[: free.text.find(stop)]
    assert "".join(pieces) == final.text
    streamed = ""
    for piece in pieces:  # no prefix of the stream ever showed a part of the stop string past the cut
        streamed += piece
        assert final.text.startswith(streamed)


def test_incremental_detokenization_decodes_short_windows(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["llama"])
    tokenizer = generator.tokenizer
    longest = []
    decode = tokenizer.decode

    def counting(ids):
        longest.append(len(ids))
        return decode(ids)

    tokenizer.decode = counting
    result = generator.generate(["The quick"], SamplingParams(max_new_tokens=100, ignore_eos=True))[0]
    tokenizer.decode = decode
    assert result.generated_tokens == 100
    assert max(longest) <= 10  # a window of the last few tokens, never the whole output
    assert result.text == decode(result.token_ids)


def test_abort_frees_the_row_at_the_next_step(tiny_artifacts):
    engine = Generator.load(tiny_artifacts["mistral"]).engine
    engine.add_request("The quick", SamplingParams(max_new_tokens=50, ignore_eos=True), request_id="a")
    engine.add_request("A KV cache", SamplingParams(max_new_tokens=50, ignore_eos=True), request_id="b")
    engine.add_request("waiting", SamplingParams(max_new_tokens=5), request_id="c")
    engine.max_batch_size = 2
    for _ in range(4):
        engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 1
    engine.abort("a")
    engine.abort("c")
    events = engine.step()
    ended = {e.request_id: e for e in events if e.finish_reason}
    assert ended["a"].finish_reason == "abort" and ended["c"].finish_reason == "abort"
    assert ended["a"].result.generated_tokens >= 1
    assert engine.stats()["running"] == 1
    while engine.has_work():
        engine.step()


def test_a_failing_request_fails_alone(tiny_artifacts, monkeypatch):
    import runtime.outputs

    generator = Generator.load(tiny_artifacts["llama"])
    real = runtime.outputs.next_token

    def failing(logits, history, params, rng):
        if params.seed == 13:
            raise FloatingPointError("probabilities do not sum to 1")
        return real(logits, history, params, rng)

    monkeypatch.setattr(runtime.outputs, "next_token", failing)
    params = [SamplingParams(max_new_tokens=6, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 13, 2)]
    results = generator.generate(["The quick", "A KV cache", "def add"], params)
    assert [r.finish_reason for r in results] == ["length", "error", "length"]
    assert results[1].error == "FloatingPointError: probabilities do not sum to 1"
    assert [r.generated_tokens for r in results] == [6, 0, 6]


def test_a_failure_outside_a_forward_pass_fails_its_requests_and_the_engine_goes_on(tiny_artifacts, monkeypatch):
    generator = Generator.load(tiny_artifacts["qwen2"])
    engine = generator.engine
    real = generator.backend.new_cache
    failures = iter([MemoryError("cannot allocate the KV cache")])

    def new_cache_once_failing(batch, capacity):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return real(batch, capacity)

    monkeypatch.setattr(generator.backend, "new_cache", new_cache_once_failing)
    engine.add_request("The quick", SamplingParams(max_new_tokens=4, n=2), request_id="a")
    events = engine.step()
    assert [(e.request_id, e.sequence, e.finish_reason) for e in events] == [("a", 0, "error"), ("a", 1, "error")]
    assert events[0].result.error == "MemoryError: cannot allocate the KV cache"
    assert not engine.has_work()
    later = generator.generate(["The quick"], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert later.generated_tokens == 4


def test_any_integer_seed_and_checked_stop_token_ids(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["llama"])
    sampled = SamplingParams(max_new_tokens=5, temperature=1.0, seed=-1, n=2, ignore_eos=True)
    first = generator.generate(["The quick"], sampled)[0]
    assert first.generated_tokens == 5 and generator.generate(["The quick"], sampled)[0].token_ids == first.token_ids
    with pytest.raises(RequestError, match=r"stop_token_ids must be in \[0, 320\)"):
        generator.engine.add_request("hi", SamplingParams(stop_token_ids=(320,)))


def test_tokens_in_flight_bound_admission_and_answers_stay_the_same(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["llama"])
    prompts, params = _requests(12, seed=7)
    alone = [generator.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    engine = generator.engine
    engine.max_tokens_in_flight = 70  # about two requests' prompt + max_new_tokens
    reach = [min(len(p) + q.max_new_tokens, engine.max_context) for p, q in zip(prompts, params, strict=True)]
    results, most = {}, 0
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, p, request_id=i)
    while engine.has_work():
        for event in engine.step():
            if event.result is not None:
                results[event.request_id] = event.result
        running = [row.request.id for row in (engine.running.rows if engine.running else []) if row is not None]
        reserved = sum(reach[i] for i in running)
        assert reserved <= 70 or len(running) == 1  # one request alone is always admitted
        most = max(most, len(running))
    assert [results[i].token_ids for i in range(len(prompts))] == alone
    assert 1 < most < len(prompts)


def test_a_padded_first_prefill_gives_each_row_its_numbers_alone(tiny_artifacts, family, monkeypatch):
    """Prompts of different lengths prefill in one step where every attention is Kiln's kernel (the
    manifest's `kernel_prefill: batched`), each row moved to the front of its buffers; row by row
    elsewhere. Either way every row's logits and keys and values equal the row's alone, bit for bit."""
    from runtime.engine import left_padded, right_aligned_mask

    generator = Generator.load(tiny_artifacts[family], "cpu-fp32")
    backend = generator.backend
    entry = generator.artifact.variant("cpu-fp32")
    # Rows stored from slot 0 wherever attention is GroupQueryAttention: every fused variant but GPT-OSS's,
    # whose attention sinks keep its attention unfused. That plain graph takes left-padded rows, like any
    # `fuse: false` variant, and promises each row its greedy tokens alone (test_generator.py), not its bits.
    assert backend.front_aligned == bool(entry.document["fusions"]["group_query_attention"])
    if not backend.front_aligned:
        pytest.skip("a plain graph's rows are left-padded: equal to alone to fp32's rounding, not bit for bit")
    batched = entry.kernel_prefill == "batched"
    assert backend.rows_alike_in_prompts == (batched and backend.kernels is not None)
    rng = np.random.default_rng(len(family))
    # 33 tokens alone end in a query block of one row (the tiny models' head size 16: blocks of 32)
    prompts = [[int(t) for t in rng.integers(1, 300, n)] for n in (9, 33, 17, 40, 24, 2)]
    ids, _ = left_padded(prompts, 0)
    lengths = np.array([len(p) for p in prompts])
    width = ids.shape[1]
    positions = np.clip(lengths[:, None] - width + np.arange(width)[None, :], 0, None)
    steps = []
    monkeypatch.setattr(backend, "_run_first_prompts", lambda *a, run=backend._run_first_prompts: steps.append(1) or run(*a))
    logits, cache = backend.run(ids, right_aligned_mask(width, lengths), positions, backend.new_cache(len(prompts), 48))
    assert steps == [1] * backend.batched_prefill
    for row, prompt in enumerate(prompts):
        alone, own = backend.run(np.array([prompt]), np.ones((1, len(prompt)), np.int64),
                                 np.arange(len(prompt))[None, :], backend.new_cache(1, 48))
        assert np.array_equal(logits[row, -1], alone[0, -1])
        for together, single in zip(cache, own, strict=True):
            assert np.array_equal(together[row, :, :len(prompt)], single[0, :, :len(prompt)])
