"""Beam search equals transformers' generate(num_beams=K, do_sample=False): the search alone on a torch
model, then through the engine on compiled artifacts, where beams are rows of the shared batch."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from runtime.beam import BeamSearch
from runtime.generator import Generator
from runtime.sampling import SamplingParams

# Not "The quick brown": there the tiny Qwen3-MoE's search met two candidates of exactly equal fp32 score
# (-42.566895) at the edge of the beams kept, an order torch.topk leaves to an unstable sort (runtime/beam.py).
PROMPTS = ["A quick brown", "A KV cache keeps", "def add(a, b):", "Paris"]


def hf_beams(model, prompt, k, max_new, eos, length_penalty=1.0, early_stopping=False, n=1):
    """transformers' beams for one prompt: the generated tokens up to and with the first EOS, and scores."""
    import torch

    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         num_beams=k, do_sample=False, max_new_tokens=max_new, eos_token_id=list(eos),
                         pad_token_id=list(eos)[0], length_penalty=length_penalty, early_stopping=early_stopping,
                         num_return_sequences=n, return_dict_in_generate=True, output_scores=True)
    rows = [row[len(prompt):].tolist() for row in out.sequences]
    cut = [next((i + 1 for i, t in enumerate(row) if t in eos), len(row)) for row in rows]
    return [row[:c] for row, c in zip(rows, cut, strict=True)], out.sequences_scores.tolist()


@pytest.fixture(scope="module")
def peaked_model():
    """A tiny Llama with large weights, so its distributions are peaked and beams end in EOS."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, initializer_range=0.3, bos_token_id=1,
                         eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def frequent_token(beams: list[list[int]]) -> int:
    """A token the beams generate often but not first: as EOS it ends beams mid-search."""
    counts: dict[int, int] = {}
    for beam in beams:
        for token in beam[1:6]:
            counts[token] = counts.get(token, 0) + 1
    return max(counts, key=counts.get)


def search_alone(model, prompt, k, max_new, eos, length_penalty, early_stopping):
    import torch

    search = BeamSearch(k, frozenset(eos), max_new, length_penalty, early_stopping)
    running = [list(prompt)] * k
    while not search.done:
        with torch.no_grad():
            logits = model(torch.tensor(running), use_cache=False).logits[:, -1].float().numpy()
        parents, tokens = search.step(logits)
        running = [running[p] + [t] for p, t in zip(parents, tokens, strict=True)]
    return search.best(k)


def test_search_matches_transformers_step_for_step(peaked_model):
    prompt = [1, 5, 9, 33]
    eos = {frequent_token(hf_beams(peaked_model, prompt, 3, 8, {127}, n=3)[0])}
    reasons = set()
    for length_penalty, early_stopping in itertools.product([1.0, 0.0, 2.0, -1.0], [False, True, "never"]):
        for k, max_new, ends in ((3, 8, eos), (4, 20, eos | {72})):
            theirs, scores = hf_beams(peaked_model, prompt, k, max_new, ends, length_penalty, early_stopping, n=k)
            ours = search_alone(peaked_model, prompt, k, max_new, ends, length_penalty, early_stopping)
            assert [h.tokens for h in ours] == theirs, (length_penalty, early_stopping, k)
            np.testing.assert_allclose([h.score for h in ours], scores, rtol=1e-5, atol=1e-6)
            reasons |= {h.finish_reason for h in ours}
    assert reasons == {"eos", "length"}  # beams that ended in EOS inside the search, and beams cut at the end


def test_top_indices_breaks_ties_like_torch_topk():
    from runtime.beam import top_indices

    scores = np.array([0.5, 1.0, 0.5, 1.0, 0.25, 0.5], np.float32)
    assert top_indices(scores, 3).tolist() == [1, 3, 0]
    assert top_indices(scores, 5).tolist() == [1, 3, 0, 2, 5]


def test_engine_beams_equal_transformers(tiny_artifacts, tiny_checkpoints, family):
    from transformers import AutoModelForCausalLM

    generator = Generator.load(tiny_artifacts[family])
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[family]).eval()
    prompts = [generator.encode(p) for p in PROMPTS]
    eos = set(generator.eos_ids)
    stop = frequent_token(hf_beams(model, prompts[0], 3, 10, eos, n=3)[0])  # an EOS the beams really meet
    ends_in_eos = 0
    for k, n, length_penalty, early_stopping, stops in ((3, 1, 1.0, False, ()), (4, 2, 2.0, False, (stop,)),
                                                         (3, 3, 0.5, True, (stop,)), (2, 2, 1.0, "never", (stop,))):
        params = SamplingParams(max_new_tokens=10, num_beams=k, n=n, length_penalty=length_penalty,
                                early_stopping=early_stopping, stop_token_ids=stops)
        # All prompts in one call, a greedy request among them: beams of several requests share the batch.
        greedy = SamplingParams(max_new_tokens=10)
        results = generator.generate(prompts + [prompts[1]], [params] * len(prompts) + [greedy])
        assert results[-1].token_ids == generator.generate([prompts[1]], greedy)[0].token_ids
        for prompt, result in zip(prompts, results, strict=False):
            theirs, scores = hf_beams(model, prompt, k, 10, eos | set(stops), length_penalty, early_stopping, n)
            beams = [result, *result.alternatives]
            assert [b.token_ids for b in beams] == theirs, (family, k, length_penalty, early_stopping)
            np.testing.assert_allclose([b.score for b in beams], scores, rtol=1e-4, atol=1e-5)
            ends_in_eos += sum(b.finish_reason == "eos" for b in beams)
    assert ends_in_eos  # some returned beams ended in EOS inside the search


def test_beam_requests_are_refused_in_one_line(tiny_artifacts):
    generator = Generator.load(tiny_artifacts["llama"])
    bad = {"n (3) must be <= num_beams (2)": SamplingParams(num_beams=2, n=3),
           "set temperature to 0": SamplingParams(num_beams=2, temperature=0.7),
           "stop strings are not supported": SamplingParams(num_beams=2, stop=("x",)),
           "this engine runs at most 32": SamplingParams(num_beams=33)}
    results = generator.generate(["The quick"] * len(bad), list(bad.values()))
    for fragment, result in zip(bad, results, strict=True):
        assert result.finish_reason == "error" and fragment in result.error


def test_run_model_prints_the_best_beams(tiny_artifacts, tmp_path):
    output = tmp_path / "o.jsonl"
    result = subprocess.run([sys.executable, "-m", "runtime.cli", str(tiny_artifacts["llama"]), "--prompt", "The quick",
                             "--num-beams", "3", "--num-return-sequences", "2", "--max-new-tokens", "6", "--output",
                             str(output)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line[:5] for line in lines] == ["[0.0]", "[0.1]"]
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["sequence"] for r in rows] == [0, 1] and rows[0]["score"] >= rows[1]["score"]
    expected = Generator.load(tiny_artifacts["llama"]).generate(
        ["The quick"], SamplingParams(max_new_tokens=6, num_beams=3, n=2))[0]
    assert rows[0]["token_ids"] == expected.token_ids


def test_batch_rows_take_beam_fields(tiny_artifacts):
    from runtime import batch

    artifact = tiny_artifacts["llama"]
    rows = [{"id": "beams", "prompt": "The quick", "max_tokens": 6, "num_beams": 3, "n": 2},
            {"id": "vllm", "prompt": "Paris", "max_tokens": 6, "use_beam_search": True, "n": 2},
            {"id": "bad", "prompt": "Paris", "max_tokens": 6, "num_beams": 2, "temperature": 0.9}]
    lines = {line["id"]: line for line in batch.run(artifact, rows)}
    generator = Generator.load(artifact)
    expected = generator.generate(["The quick", "Paris"], SamplingParams(max_new_tokens=6, num_beams=3, n=2))
    assert [c["text"] for c in lines["beams"]["choices"]] == [expected[0].text, expected[0].alternatives[0].text]
    two = generator.generate(["Paris"], SamplingParams(max_new_tokens=6, num_beams=2, n=2))[0]
    assert [c["text"] for c in lines["vllm"]["choices"]] == [two.text, two.alternatives[0].text]
    assert "set temperature to 0" in lines["bad"]["error"]["message"]
