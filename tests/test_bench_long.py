"""bench/long.py on a tiny model: a Kiln variant and an onnxruntime-genai folder side by side at two depths,
its JSON and table, the floors from the cache it measured; bad arguments are one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _long(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "long.py"), *args], capture_output=True, text=True,
                          timeout=600)


def test_long_writes_prefill_and_decode_at_each_depth(tiny_artifacts, tmp_path):
    from runtime.artifact import Artifact

    artifact = tiny_artifacts["llama"]
    out = tmp_path / "long.json"
    done = _long(f"kiln={artifact}:cpu-fp32", f"genai={artifact / 'variants' / 'cpu-fp32'}", "--depths", "16", "40",
                 "--batches", "1", "2", "--steps", "2", "--rounds", "1", "--threads", "1", "--output", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    interface = Artifact.open(artifact).variant("cpu-fp32").interface
    kiln, genai = report["variants"]["kiln"], report["variants"]["genai"]
    # fp32 keys and values of every layer, as the backend allocated them
    assert kiln["kv_bytes_per_token"] == 2 * interface.layers * interface.kv_heads * interface.head_dim * 4
    for result in (kiln, genai):
        assert set(result["depths"]) == {"16", "40"}
        for cell in result["depths"].values():
            assert cell["prefill_tok_s"] > 0 and set(cell["decode_tok_s"]) == {"1", "2"}
            assert all(v > 0 for v in cell["decode_tok_s"].values())
    floors = {depth: cell["decode_floor_tok_s"] for depth, cell in kiln["depths"].items()}
    assert floors["40"]["2"] < floors["16"]["2"] and "decode_floor_tok_s" not in genai["depths"]["16"]
    assert "| kiln | 16 |" in done.stdout and "| genai | 40 |" in done.stdout


def test_long_refuses_a_llama_bench_without_its_model(tiny_artifacts, tmp_path):
    done = _long(f"kiln={tiny_artifacts['llama']}:cpu-fp32", "--llama-bench", str(tmp_path / "llama-bench"))
    assert done.returncode != 0 and done.stderr.strip().count("\n") == 0
    assert "--llama-bench and --gguf go together" in done.stderr
