"""bench/peers.py's accuracy columns: the held-out text it scores and how it counts the predictions
that differ."""

from __future__ import annotations

import numpy as np

from bench.peers import HELDOUT, accuracy, text_rows
from compiler.accuracy import TEXT_ROW_TOKENS

ROOT = HELDOUT.parents[2]


def test_the_benchmarks_text_is_the_compiles_and_more_scored_whole(tiny_artifacts):
    from runtime.generator import Generator

    compile_text = (ROOT / "compiler" / "data" / "heldout.txt").read_text()
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


def test_the_targets_are_judged_from_the_rows_the_host_runs():
    """issue_targets reads the saved run's rows: each target flips with the cell it names, and a row on
    MLAS, which the host does not run by default, is printed but not judged."""
    import copy

    from bench.peers import ALONE_PROMPTS, issue_targets, read_report

    saved = read_report(ROOT / "bench" / "results" / "peers.json")

    def judged(change) -> dict[str, bool]:
        report = copy.deepcopy(saved)
        rows = {r["backend"]: r for r in report["rows"]}
        change(rows, report["floors"])
        return {t["target"].split(":")[0]: t["met"] for t in issue_targets(report)}

    def int8_b1(x):
        return lambda rows, floors: rows["Kiln cpu-int8"]["x_genai"].update({1: x})

    names = list(judged(int8_b1(1.21)))
    assert len(names) == 9
    int8_speed = next(n for n in names if n.startswith("int8 batch 1"))
    assert judged(int8_b1(1.21))[int8_speed] and not judged(int8_b1(1.19))[int8_speed]
    ahead = names[0]
    assert not judged(int8_b1(0.99))[ahead]

    def invariance(row, equal):
        return lambda rows, floors: rows[row].update(batch8_equal_batch1=equal)

    batch = next(n for n in names if n.startswith("batch invariance"))
    assert judged(invariance("Kiln cpu-int4", ALONE_PROMPTS))[batch]
    assert not judged(invariance("Kiln cpu-int4", ALONE_PROMPTS - 1))[batch]

    def on_mlas(rows, floors):  # slower than genai, on the path a host without the kernels takes
        rows["Kiln cpu-int8 on MLAS"]["x_genai"] = {b: 0.5 for b in (1, 8, 32)}
        rows["Kiln cpu-int8"]["x_genai"] = {b: 1.5 for b in (1, 8, 32)}
    assert judged(on_mlas)[ahead] == judged(lambda rows, floors: rows["Kiln cpu-int8"]["x_genai"].update(
        {b: 1.5 for b in (1, 8, 32)}))[ahead]

    def fp32_b1(share):
        return lambda rows, floors: rows["Kiln cpu-fp32"].update(
            b1_tokens_per_s=share * floors["b1_fp32_tokens_per_s"])

    floor = next(n for n in names if n.startswith("fp32 batch 1"))
    assert judged(fp32_b1(0.91))[floor] and not judged(fp32_b1(0.89))[floor]


def test_show_prints_a_saved_run_and_refuses_anything_else_in_one_line(tmp_path):
    import subprocess
    import sys

    script = ROOT / "bench" / "peers.py"
    shown = subprocess.run([sys.executable, str(script), "--show", str(ROOT / "bench" / "results" / "peers.json")],
                           capture_output=True, text=True, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr
    assert "| Kiln cpu-fp32 |" in shown.stdout and shown.stdout.count("\ntarget ") == 9
    (tmp_path / "other.json").write_text('{"rows": []}')
    refused = subprocess.run([sys.executable, str(script), "--show", str(tmp_path / "other.json")],
                             capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode != 0 and refused.stdout == ""
    assert refused.stderr.strip().count("\n") == 0 and "not a saved bench/peers.py run" in refused.stderr
