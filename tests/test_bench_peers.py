"""bench/peers.py's accuracy columns: the held-out text it scores and how it counts the predictions
that differ."""

from __future__ import annotations

import numpy as np

from bench.peers import HELDOUT, accuracy, text_rows
from compiler.accuracy import TEXT_ROW_TOKENS

ROOT = HELDOUT.parents[2]


def test_the_benchmarks_text_is_the_compiles_and_more_scored_whole(tiny_artifacts):
    from runtime.generator import Generator

    compile_text = (ROOT / "recipes" / "data" / "heldout.txt").read_text()
    text = HELDOUT.read_text()
    assert text.startswith(compile_text) and len(text) > 6 * len(compile_text)

    generator = Generator.load(tiny_artifacts["llama"])
    rows = text_rows(generator)
    ids = generator.tokenizer.encode(text, add_special_tokens=False)
    assert [t for row in rows for t in row] == ids[:len(ids) - (len(ids) % TEXT_ROW_TOKENS == 1)]
    assert all(len(row) == TEXT_ROW_TOKENS for row in rows[:-1]) and len(rows[-1]) > 1
    assert sum(map(len, rows)) > 1024  # past the compile's cap: the whole text is scored


def test_accuracy_counts_the_predictions_that_differ():
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(0, 50, 9)), list(rng.integers(0, 50, 5))]
    reference = [rng.standard_normal((len(row), 50)).astype(np.float32) for row in rows]
    moved = [logits.copy() for logits in reference]
    for row, position in ((0, 2), (0, 8), (1, 0)):  # another token on top at three positions
        moved[row][position, (reference[row][position].argmax() + 1) % 50] = 100.0

    same, other = accuracy(reference, reference, rows), accuracy(reference, moved, rows)
    assert same["top1_differ"] == 0 and same["top1_agreement"] == 1.0
    assert other["top1_differ"] == 3 and other["top1_agreement"] == 11 / 14
    assert other["perplexity"] != same["perplexity"]
