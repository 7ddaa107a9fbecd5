"""Batched decoding: greedy batched == one at a time == transformers' eager generate, every family."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from runtime.generator import Generator
from runtime.sampling import SamplingParams

PROMPTS = [
    "The quick brown fox",
    "A KV cache keeps the keys and values of earlier tokens. Prefill runs",
    "def add(a, b):",
    "Paris is the capital of",
]


def _eager_greedy(checkpoint, prompt_ids, max_new_tokens, eos):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    out = []
    for ids in prompt_ids:
        with torch.no_grad():
            tokens = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
        out.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return out


def test_greedy_batched_equals_single_equals_eager(tiny_artifacts, tiny_checkpoints, family):
    generator = Generator.load(tiny_artifacts[family], max_batch_size=8)
    params = SamplingParams(max_new_tokens=16)
    batched = generator.generate(PROMPTS, params)
    single = [generator.generate([p], params)[0] for p in PROMPTS]
    assert [r.token_ids for r in batched] == [r.token_ids for r in single]
    prompt_ids = [generator.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompt_ids}) > 1  # mixed lengths, so the batch really is padded
    eager = _eager_greedy(tiny_checkpoints[family], prompt_ids, 16, eos=0)
    assert [r.token_ids for r in batched] == eager
    for result, ids in zip(batched, prompt_ids, strict=True):
        assert result.prompt_tokens == len(ids) and result.generated_tokens == len(result.token_ids)
        assert result.finish_reason == ("eos" if result.token_ids[-1] == 0 else "length")


def test_max_batch_size_splits_and_keeps_order(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["llama"], max_batch_size=8)
    small = Generator.load(tiny_artifacts["llama"], max_batch_size=1)
    params = SamplingParams(max_new_tokens=6)
    assert [r.token_ids for r in small.generate(PROMPTS, params)] == [r.token_ids for r in generator.generate(PROMPTS, params)]


def test_bad_requests_fail_alone(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["qwen2"])
    good = SamplingParams(max_new_tokens=4)
    results = generator.generate(
        ["fine", "", "x " * 200, "also fine", "sampled"],
        [good, good, good, good, SamplingParams(temperature=1.0, top_p=1.5)],
    )
    assert [r.error is None for r in results] == [True, False, False, True, False]
    assert results[1].error == "empty prompt"
    assert "max context is 128" in results[2].error
    assert results[4].error == "top_p must be in (0, 1], got 1.5"
    assert results[0].generated_tokens >= 1 and results[3].generated_tokens >= 1
    assert SamplingParams(temperature=-1).problem() == "temperature must be >= 0 (0 is greedy), got -1"


def test_stop_string_across_token_boundaries(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["gpt2"])
    free = generator.generate(["The quick"], SamplingParams(max_new_tokens=20))[0]
    ids = free.token_ids
    # Pick a stop string that starts inside one token and ends inside a later one.
    pieces = [generator.tokenizer.decode(ids[: i + 1]) for i in range(len(ids))]
    k = next(i for i in range(1, len(ids)) if len(pieces[i]) - len(pieces[i - 1]) >= 1 and len(pieces[i - 1]) >= 2)
    stop = pieces[k][len(pieces[k - 1]) - 1 : len(pieces[k - 1]) + 1]
    assert len(stop) == 2
    result = generator.generate(["The quick"], SamplingParams(max_new_tokens=20, stop=(stop,)))[0]
    assert result.finish_reason == "stop"
    assert stop not in result.text and free.text.startswith(result.text)
    assert result.text == free.text[: free.text.find(stop)]


def test_stream_yields_the_same_text(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["mistral"])
    params = SamplingParams(max_new_tokens=12)
    expected = generator.generate(PROMPTS[:2], params)
    pieces = {0: "", 1: ""}
    finished = {}
    for event in generator.stream(PROMPTS[:2], params):
        pieces[event.index] += event.text
        if event.result is not None:
            finished[event.index] = event.result
    assert pieces == {0: expected[0].text, 1: expected[1].text}
    assert [finished[i].token_ids for i in (0, 1)] == [r.token_ids for r in expected]


def test_seeded_sampling_is_reproducible_across_batch_sizes(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["llama"], max_batch_size=8)
    params = [SamplingParams(max_new_tokens=10, temperature=1.2, top_k=50, top_p=0.95, seed=i) for i in range(4)]
    together = generator.generate(PROMPTS, params)
    alone = [generator.generate([p], [q])[0] for p, q in zip(PROMPTS, params, strict=True)]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    again = generator.generate(PROMPTS[::-1], params[::-1])[::-1]
    assert [r.token_ids for r in again] == [r.token_ids for r in together]
    other_seed = generator.generate(PROMPTS, [SamplingParams(max_new_tokens=10, temperature=1.2, seed=99)] * 4)
    assert [r.token_ids for r in other_seed] != [r.token_ids for r in together]


def test_chat_prompt_uses_the_template(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["llama"])
    ids = generator.encode([{"role": "user", "content": "hi"}])
    assert generator.tokenizer.decode(ids) == "<|user|>hi<|end|><|assistant|>"


def test_runtime_never_imports_torch(tiny_artifacts):
    code = (
        "import sys, json\n"
        "from runtime.generator import Generator\n"
        "from runtime.sampling import SamplingParams\n"
        "import runtime.kiln_cli, runtime.ship, runtime.backends.tensorrt, runtime.server\n"
        f"runtime.ship.check_integrity(__import__('pathlib').Path({str(tiny_artifacts['llama'])!r}))\n"
        f"g = Generator.load({str(tiny_artifacts['llama'])!r})\n"
        "r = g.generate(['hello'], SamplingParams(max_new_tokens=3))[0]\n"
        "assert r.generated_tokens >= 1\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'transformers', 'compiler', 'onnx', 'onnxscript'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_cli_generates_and_refuses_tampered(tiny_artifacts, tmp_path):
    import shutil

    ok = subprocess.run([sys.executable, "-m", "runtime.cli", str(tiny_artifacts["qwen2"]), "--prompt", "The quick",
                         "--prompt", "", "--max-new-tokens", "5", "--output", str(tmp_path / "o.jsonl")],
                        capture_output=True, text=True)
    assert ok.returncode == 1  # one of the two prompts was refused, the other answered
    assert "prompt 1: empty prompt" in ok.stderr
    rows = sorted((json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()),
                  key=lambda row: row["index"])  # written as they finish: the refused one first
    assert rows[0]["generated_tokens"] >= 1 and rows[1]["error"] == "empty prompt"
    copy = shutil.copytree(tiny_artifacts["qwen2"], tmp_path / "copy")
    model = copy / "variants" / "cpu-fp32" / "model.onnx"
    data = bytearray(model.read_bytes())
    data[-1] ^= 1
    model.write_bytes(bytes(data))
    bad = subprocess.run([sys.executable, "-m", "runtime.cli", str(copy), "--prompt", "x"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"run-model: error: {copy}: file variants/cpu-fp32/model.onnx fails its sha256 check (modified after compile)"


def test_filters_match_transformers_warpers():
    import torch
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from runtime.sampling import apply_repetition_penalty, filtered_probabilities

    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=200).astype(np.float32) * 3
        history = rng.integers(0, 200, 15)
        p = SamplingParams(temperature=float(rng.uniform(0.3, 2)), top_k=int(rng.integers(0, 60)),
                           top_p=float(rng.uniform(0.5, 1)), min_p=float(rng.uniform(0, 0.2)), repetition_penalty=1.3)
        penalized = apply_repetition_penalty(logits, np.unique(history), 1.3)
        ours = filtered_probabilities(penalized, p)
        scores = torch.tensor(logits)[None]
        ids = torch.tensor(history)[None]
        scores = RepetitionPenaltyLogitsProcessor(1.3)(ids, scores)
        for warper in (TemperatureLogitsWarper(p.temperature), TopKLogitsWarper(p.top_k) if p.top_k else None,
                       TopPLogitsWarper(p.top_p), MinPLogitsWarper(p.min_p) if p.min_p else None):
            if warper is not None:
                scores = warper(ids, scores)
        theirs = torch.softmax(scores.double(), -1)[0].numpy()
        assert np.array_equal(ours > 0, theirs > 0)
        np.testing.assert_allclose(ours, theirs, atol=1e-6)


def test_chat_prompt_without_template_fails_alone(tiny_artifacts, tmp_path):
    import shutil

    copy = shutil.copytree(tiny_artifacts["gpt2"], tmp_path / "copy")
    (copy / "tokenizer" / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((copy / "tokenizer" / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (copy / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(config))
    generator = Generator.load(copy, verify=False)
    results = generator.generate(["plain", [{"role": "user", "content": "hi"}]], SamplingParams(max_new_tokens=3))
    assert results[0].error is None and results[0].generated_tokens >= 1
    assert results[1].error == "the model has no chat template, so chat prompts cannot be used"


def test_fused_graph_decodes_exactly_like_the_unfused_one(tiny_artifacts, family):
    # GroupQueryAttention over shared buffers, with rows leaving the batch at different steps.
    prompts = ["The quick brown", "def add(a, b):", "Hello", "A much longer prompt than the others, with padding"]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 12, 7, 9)]
    fused = Generator.load(tiny_artifacts[family], "cpu-fp32").generate(prompts, params)
    unfused = Generator.load(tiny_artifacts[family], "cpu-fp32-unfused").generate(prompts, params)
    assert [r.token_ids for r in fused] == [r.token_ids for r in unfused]
    assert [len(r.token_ids) for r in fused] == [3, 12, 7, 9]


def test_lone_row_detection_compares_a_row_alone_with_the_same_row_beside_a_copy(tiny_artifacts, monkeypatch):
    """lone_row_differs on a real session: Kiln's kernels give a row the same numbers alone and batched;
    a session whose lone row comes out one ulp off (as ONNX Runtime's 4-bit MatMulNBits did on an AMD EPYC
    without AVX-512) is caught."""
    from runtime import cpu_kernels

    backend = Generator.load(tiny_artifacts["llama"], threads=2).backend
    if cpu_kernels.library()[0] is not None:
        assert backend.lone_row_differs() is False and backend.min_rows == 1
    run = backend._run_in_place

    def lone_row_off_by_an_ulp(ids, mask, positions, cache):
        logits, cache = run(ids, mask, positions, cache)
        if len(logits) == 1:
            logits[0, 0, 0] = np.nextafter(logits[0, 0, 0], np.inf)
        return logits, cache

    monkeypatch.setattr(backend, "_run_in_place", lone_row_off_by_an_ulp)
    assert backend.lone_row_differs() is True


def test_lone_rows_run_beside_a_spare_with_the_same_numbers(tiny_artifacts, monkeypatch):
    """Where a CPU's kernels give a row alone other numbers than the same row batched, the backend finds
    out on load (min_rows = 2) and never runs a lone row (runtime/backends/onnxruntime.py, lone rows). Forced here
    on the fp32 tiny Llama: a lone sequence's steps beside a spare row, a batch shrinking to one, and a
    one-token prompt prefilled beside longer ones (in a scratch cache) give the plain run's logits,
    bit for bit, so the dummy rows touch nothing of the real ones."""
    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    plain = Generator.load(tiny_artifacts["llama"], threads=2)
    differs = OnnxRuntimeBackend.lone_row_differs
    monkeypatch.setattr(OnnxRuntimeBackend, "lone_row_differs", lambda self: True)  # as on such a CPU
    spare = Generator.load(tiny_artifacts["llama"], threads=2)
    monkeypatch.setattr(OnnxRuntimeBackend, "lone_row_differs", differs)
    assert spare.backend.min_rows == 2 and plain.backend.min_rows == 1 + differs(plain.backend)
    used = {"dummy": 0, "scratch": 0}
    dummy, scratch = OnnxRuntimeBackend._beside_dummy, OnnxRuntimeBackend._run_lone_row
    monkeypatch.setattr(OnnxRuntimeBackend, "_beside_dummy", staticmethod(
        lambda *a: used.__setitem__("dummy", used["dummy"] + 1) or dummy(*a)))
    monkeypatch.setattr(OnnxRuntimeBackend, "_run_lone_row",
                        lambda self, *a: used.__setitem__("scratch", used["scratch"] + 1) or scratch(self, *a))
    prompts = [[5], [7, 8, 9, 10, 11], [12, 13]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=0) for n in (9, 5, 2)]
    expected = [plain.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    alone = [spare.generate([p], q)[0] for p, q in zip(prompts, params, strict=True)]
    assert used == {"dummy": 8 + 4 + 1 + 1, "scratch": 0}  # every step of a lone sequence, the 1-token prefill too
    together = spare.generate(prompts, params)
    assert used == {"dummy": 15, "scratch": 1}  # the one-token prompt's prefill, beside its dummy
    for results in (alone, together):
        assert [r.token_ids for r in results] == [r.token_ids for r in expected]
        assert [[t.logprob for t in r.logprobs] for r in results] == [[t.logprob for t in r.logprobs] for r in expected]
    # A batch cut down to one row gets a spare; one grown from it turns the spare into a row.
    backend, cache = spare.backend, spare.backend.new_cache(2, 8)
    backend.run(np.array([[5, 6], [7, 8]]), np.ones((2, 2), np.int64), np.array([[0, 1], [0, 1]]), cache)
    one = backend.keep_rows(cache, [1])
    assert one.batch == 1 and one[0].shape[0] == 2
    step = (np.array([[9]]), np.ones((1, 3), np.int64), np.array([[2]]))
    lone, one = backend.run(*step, one)
    reference = plain.backend.new_cache(1, 8)
    plain.backend.run(np.array([[7, 8]]), np.ones((1, 2), np.int64), np.array([[0, 1]]), reference)
    assert np.array_equal(lone, plain.backend.run(*step, reference)[0])
    grown = backend.keep_rows(one, [0, -1])
    assert grown.batch == 2 and grown[0].shape[0] == 2 and not grown[0][1].any()
