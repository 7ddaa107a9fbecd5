"""`quantize.exclude: auto`: the sensitivity table and the search for the fewest groups kept in fp32,
compiled for real on the tiny Llama."""

from __future__ import annotations

import json

import onnx
import pytest

from compiler.pipeline import compile_recipe
from compiler.quantize import weight_matmuls
from compiler.sensitivity import fewest_kept, module_groups
from tests.conftest import write_recipe


def test_module_groups_are_parent_modules_in_graph_order():
    paths = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.up_proj",
             "model.layers.1.mlp.down_proj", "lm_head"]
    assert module_groups(paths) == {
        "model.layers.0.self_attn": ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"],
        "model.layers.0.mlp": ["model.layers.0.mlp.up_proj"], "model.layers.1.mlp": ["model.layers.1.mlp.down_proj"],
        "lm_head": ["lm_head"]}


@pytest.mark.parametrize("needed", [0, 1, 2, 3, 7, 12, 13])
def test_the_search_finds_the_fewest_in_few_attempts(needed):
    ranking = [{"group": str(i)} for i in range(13)]
    tried = []

    def attempt(count):
        tried.append(count)
        return count >= needed

    assert fewest_kept(ranking, attempt) == needed
    assert len(tried) == len(set(tried)) <= 9  # doubling then bisection, never the same count twice


def test_the_search_says_when_nothing_passes():
    assert fewest_kept([{"group": "a"}, {"group": "b"}, {"group": "c"}], lambda count: False) is None


def _compile(tiny_checkpoints, root, gates):
    root.mkdir()
    variants = f"  - {{name: cpu-int4, target: onnxruntime, quantize: {{mode: int4, exclude: auto}}, gates: {gates}}}\n"
    recipe = write_recipe(root / "r.yaml", tiny_checkpoints["llama"], variants=variants,
                          extra="validate: {max_new_tokens: 8}\n")
    artifact = compile_recipe(recipe, root / "artifact", keep_failed=True)
    manifest = json.loads((artifact / "manifest.json").read_text())
    entry = manifest["variants"]["cpu-int4"]
    return artifact, entry, json.loads((artifact / entry["report"]).read_text())


def test_exclude_auto_keeps_the_fewest_sensitive_groups_that_meet_the_gates(tiny_checkpoints, tmp_path):
    # Unreachable (fp32 itself is not that close to eager): every prefix is tried and recorded, and the
    # variant is built with nothing kept, failing its gate, so the user sees what quantizing costs.
    _, entry, report = _compile(tiny_checkpoints, tmp_path / "unreachable", "{max_logit_error: 1.0e-12}")
    found = report["exclude_auto"]
    assert [r["group"] for r in found["sensitivity"]] != [] and not found["met_gates"]
    assert sorted(r["group"] for r in found["sensitivity"]) == sorted(
        ["lm_head", *(f"model.layers.{i}.{part}" for i in (0, 1) for part in ("self_attn", "mlp"))])
    kls = [r["kl_divergence"] for r in found["sensitivity"]]
    assert kls == sorted(kls, reverse=True) and kls[0] > 0
    assert [a["groups_in_fp32"] for a in found["attempts"]] == [0, 1, 2, 4, 5]
    assert entry["status"] == "failed" and report["quantize"]["kept_fp32"] == []

    # A gate between what two and what one group in fp32 measured: the search keeps two (or fewer, if
    # fewer already pass), the most sensitive ones, and every smaller count it tried failed.
    top1 = {a["groups_in_fp32"]: a["top1_agreement"] for a in found["attempts"]}
    assert top1[5] == 1.0 and top1[0] < top1[2]
    threshold = top1[2]
    artifact, entry, report = _compile(tiny_checkpoints, tmp_path / "reachable", f"{{top1_agreement: {threshold}}}")
    found = report["exclude_auto"]
    assert entry["status"] == "built" and found["met_gates"]
    kept = found["groups_in_fp32"]
    assert kept == [r["group"] for r in found["sensitivity"][:len(kept)]] and 0 < len(kept) <= 2
    assert all(a["failed_gates"] for a in found["attempts"] if a["groups_in_fp32"] < len(kept))
    modules = [m for r in found["sensitivity"][:len(kept)] for m in r["modules"]]
    assert sorted(report["quantize"]["kept_fp32"]) == sorted(modules)
    assert entry["accuracy"]["top1_agreement"] >= threshold
    markdown = (artifact / "reports" / "cpu-int4.md").read_text()
    assert "## Where accuracy goes" in markdown and all(
        f"| {r['group']} |".replace("_", "\\_") in markdown for r in found["sensitivity"])  # Markdown-escaped
    assert "<table id='sensitivity'>" in (artifact / "reports" / "cpu-int4.html").read_text()
    graph = onnx.load(str(artifact / entry["model"]))
    assert weight_matmuls(graph)  # the kept groups' weights run in fp32
