"""bench/ab_step.py: an onnxruntime-genai model folder runs beside Kiln's variants, driven as genai
drives it (a variant folder is one: Kiln writes genai_config.json beside each graph), and `--alone`
runs each variant in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.ab_step import load

ROOT = Path(__file__).resolve().parents[1]


def test_genai_folder_step_gives_the_logits_of_kilns_backend(tiny_artifacts):
    artifact = tiny_artifacts["llama"]
    kiln = load(f"{artifact}:cpu-fp32", 1)
    genai = load(str(artifact / "variants" / "cpu-fp32"), 1)
    past, batch = 5, 2
    tokens = np.array([[3], [7]], np.int64)
    mask = np.ones((batch, past + 1), np.int64)
    position = np.full((batch, 1), past, np.int64)
    longer = np.ones((batch, past + 2), np.int64)
    logits = []
    for backend in (kiln, genai):
        cache = backend.new_cache(batch, past + 8)
        first, cache = backend.run(tokens, mask, position, cache)
        first = np.array(first)  # genai's step returns its bound array, which the next step overwrites
        second = np.array(backend.run(tokens, longer, position + 1, cache)[0])
        # The same second step over empty buffers: it differs only if the first step's keys were kept.
        unkept = np.array(backend.run(tokens, longer, position + 1, backend.new_cache(batch, past + 8))[0])
        assert not np.allclose(second, unkept)
        logits.append((first, second))
    for kiln_logits, genai_logits in zip(*logits, strict=True):
        assert kiln_logits.shape == genai_logits.shape
        np.testing.assert_allclose(genai_logits, kiln_logits, atol=1e-4)


def test_alone_runs_write_each_variants_rounds(tiny_artifacts, tmp_path):
    artifact = tiny_artifacts["llama"]
    out = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "ab_step.py"), f"kiln={artifact}:cpu-fp32",
                           f"genai={artifact / 'variants' / 'cpu-fp32'}", "--batch", "1", "--threads", "1",
                           "--rounds", "3", "--steps", "2", "--alone", "--output", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    cell = json.loads(out.read_text())["cells"][0]
    assert cell["alone"] and set(cell["variants"]) == {"kiln", "genai"}
    assert all(len(v["ms"]) == 3 and min(v["ms"]) > 0 and v["median_ms_by_load_position"] is None
               for v in cell["variants"].values())
    assert 0 < cell["variants"]["genai"]["paired_ratio_to_first"] < 10  # the same graph, run two ways
    assert "(each alone)" in done.stdout


def test_a_folder_without_a_genai_config_is_refused_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "ab_step.py"), f"a={tmp_path}", f"b={tmp_path}"],
                          capture_output=True, text=True)
    assert done.returncode != 0
    assert "NAME=GENAI_FOLDER" in done.stderr.strip().splitlines()[-1]
