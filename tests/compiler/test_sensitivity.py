"""`quantize.exclude: auto`: the sensitivity table and the search for the groups kept in fp32,
compiled for real on the tiny Llama."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from compiler.pipeline import compile_recipe
from compiler.sensitivity import fewest_kept, lightest_kept, module_groups
from compiler.weights import weight_matmuls
from tests.conftest import VOCAB, write_recipe


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


# (group, KL quantized alone, weight elements, what it costs the gates quantized): a heavy LM head high
# in KL that the gates hardly see, as SmolLM2's with its top logits recomputed in fp32.
GROUPS = [("a", 6.0, 10, 4.0), ("lm_head", 5.0, 100, 0.1), ("b", 3.0, 10, 3.0), ("c", 1.0, 10, 1.0),
          ("d", 0.6, 10, 0.6)]


@pytest.mark.parametrize("allowed, kept", [
    (9.0, []),  # nothing needs keeping
    (5.0, ["a"]),
    (2.0, ["a", "b"]),  # the prefix a, LM head, b; then the LM head is dropped, the rest still needed
    (0.05, ["a", "lm_head", "b", "c", "d"]),
    (-1.0, None)])  # not even all of them
def test_the_search_keeps_a_prefix_by_kl_less_what_the_gates_pass_without(allowed, kept):
    ranking = [{"group": g, "kl_divergence": kl, "weight_elements": w} for g, kl, w, _ in GROUPS]
    tried = []

    def attempt(groups):  # passes when the cost of what stays quantized adds up to at most `allowed`
        tried.append([r["group"] for r in groups])
        return sum(cost for g, _, _, cost in GROUPS if g not in tried[-1]) <= allowed

    found = lightest_kept(ranking, attempt)
    assert (found if found is None else [r["group"] for r in found]) == kept
    for group in kept or []:  # here each kept group was tried without, after the last drop
        assert [g for g in kept if g != group] in tried
    assert len(tried) == len({frozenset(t) for t in tried})  # a set of groups built once


def _compile(tiny_checkpoints, root, gates, quantize=""):
    root.mkdir()
    variants = (f"  - {{name: cpu-int4, target: onnxruntime, quantize: {{mode: int4, exclude: auto{quantize}}}, "
                f"gates: {gates}}}\n")
    recipe = write_recipe(root / "r.yaml", tiny_checkpoints["llama"], variants=variants,
                          extra="validate: {max_new_tokens: 8}\n")
    artifact = compile_recipe(recipe, root / "artifact", keep_failed=True)
    manifest = json.loads((artifact / "manifest.json").read_text())
    entry = manifest["variants"]["cpu-int4"]
    return artifact, entry, json.loads((artifact / entry["report"]).read_text())


def test_exclude_auto_keeps_the_sensitive_groups_the_gates_need(tiny_checkpoints, tmp_path):
    # Unreachable (fp32 itself is not that close to eager): every prefix is tried and recorded, and the
    # variant is built with nothing kept, failing its gate, so the user sees what quantizing costs.
    _, entry, report = _compile(tiny_checkpoints, tmp_path / "unreachable", "{max_logit_error: 1.0e-12}")
    found = report["exclude_auto"]
    assert [r["group"] for r in found["sensitivity"]] != [] and not found["met_gates"]
    assert sorted(r["group"] for r in found["sensitivity"]) == sorted(
        ["lm_head", *(f"model.layers.{i}.{part}" for i in (0, 1) for part in ("self_attn", "mlp"))])
    kls = [r["kl_divergence"] for r in found["sensitivity"]]
    assert kls == sorted(kls, reverse=True) and kls[0] > 0
    weights = {r["group"]: r["weight_elements"] for r in found["sensitivity"]}
    assert weights["lm_head"] == VOCAB * 64 and weights["model.layers.0.mlp"] == 3 * 64 * 128  # tiny Llama's shapes
    assert [a["groups_kept"] for a in found["attempts"]] == [0, 1, 2, 4, 5]
    assert entry["status"] == "failed" and report["quantize"]["kept_fp32"] == []
    assert found["kept_as"] == "in fp32"
    assert entry["quantize"]["exclude"] == "auto"  # the manifest records the recipe; the report what it found

    # Kept in finer blocks instead (exclude_block_size): the same ranking (each group alone, the rest in
    # fp32), the same prefixes tried, each measured with its kept groups quantized in blocks of 16.
    _, entry, finer = _compile(tiny_checkpoints, tmp_path / "finer", "{max_logit_error: 1.0e-12}",
                               ", exclude_block_size: 16")
    assert finer["exclude_auto"]["kept_as"] == "in blocks of 16"
    assert finer["exclude_auto"]["sensitivity"] == found["sensitivity"]
    by_count = {a["groups_kept"]: a for a in finer["exclude_auto"]["attempts"]}
    assert list(by_count) == [0, 1, 2, 4, 5] and by_count[0]["top1_agreement"] == found["attempts"][0]["top1_agreement"]
    assert by_count[5]["perplexity_change"] != 0.0  # every group kept is still quantized, in finer blocks
    markdown = (tmp_path / "finer" / "artifact" / "reports" / "cpu-int4.md").read_text()
    assert "| groups kept |" in markdown and "groups in blocks of 16 met the gates" in markdown

    # A gate between what two and what one group in fp32 measured: the search keeps at most those two,
    # the most sensitive, less any the gate passes without; every lighter attempt failed.
    top1 = {a["groups_kept"]: a["top1_agreement"] for a in found["attempts"]}
    assert top1[5] == 1.0 and top1[0] < top1[2]
    threshold = top1[2]
    artifact, entry, report = _compile(tiny_checkpoints, tmp_path / "reachable", f"{{top1_agreement: {threshold}}}")
    found = report["exclude_auto"]
    assert entry["status"] == "built" and found["met_gates"]
    kept = found["groups_kept"]
    assert 0 < len(kept) <= 2 and set(kept) <= {r["group"] for r in found["sensitivity"][:2]}
    assert found["weights_kept"] == sum(weights[g] for g in kept) / sum(weights.values())
    tried = {frozenset(a["groups"]): a["failed_gates"] for a in found["attempts"]}
    assert not tried[frozenset(kept)] and all(tried[frozenset(kept) - {g}] for g in kept)
    modules = [m for r in found["sensitivity"] if r["group"] in kept for m in r["modules"]]
    assert sorted(report["quantize"]["kept_fp32"]) == sorted(modules)
    assert entry["accuracy"]["top1_agreement"] >= threshold
    markdown = (artifact / "reports" / "cpu-int4.md").read_text()
    assert "## Where accuracy goes" in markdown and all(
        f"| {r['group']} |".replace("_", "\\_") in markdown for r in found["sensitivity"])  # Markdown-escaped
    assert "<table id='sensitivity'>" in (artifact / "reports" / "cpu-int4.html").read_text()
    graph = onnx.load(str(artifact / entry["model"]))
    assert weight_matmuls(graph)  # the kept groups' weights run in fp32

    # Gates everything quantized meets: one attempt, and no per-group ranking (a build per group) at all.
    artifact, entry, report = _compile(tiny_checkpoints, tmp_path / "loose", "{perplexity_change: 10.0}")
    found = report["exclude_auto"]
    assert entry["status"] == "built" and found["met_gates"] and found["sensitivity"] == []
    assert [(a["groups_kept"], a["failed_gates"]) for a in found["attempts"]] == [(0, [])]
    assert report["quantize"]["kept_fp32"] == [] and not weight_matmuls(onnx.load(str(artifact / entry["model"])))
    assert "no per-group ranking measured" in (artifact / "reports" / "cpu-int4.md").read_text()
    html = (artifact / "reports" / "cpu-int4.html").read_text()
    assert "<table id='sensitivity'>" not in html
    # Where accuracy goes is still there, layer by layer, from the one quantized graph.
    assert [(r["block"], r["point"]) for r in report["layerwise"]] == [
        *((f"model.layers.{i}.{part}", "residual stream") for i in (0, 1) for part in ("self_attn", "mlp")),
        ("lm_head", "logits")]
    markdown = (artifact / "reports" / "cpu-int4.md").read_text()
    assert "<table id='layerwise'>" in html and "| model.layers.1.mlp |" in markdown
    assert "| lm\\_head -\\> logits |" in markdown  # Markdown-escaped


def _layerwise(artifact: Path, folder: Path, **quantize_spec) -> list[dict]:
    """The layerwise table of the tiny Llama's fp32 graph quantized to int4 as `quantize_spec` says."""
    from compiler.graph import OnnxArtifact
    from compiler.quantize import quantize
    from compiler.recipe import Variant
    from compiler.sensitivity import residual_errors

    entry = json.loads((artifact / "manifest.json").read_text())["variants"]["cpu-fp32"]
    source = OnnxArtifact((artifact / entry["model"]).parent, entry["interface"], None, 0)
    calibration = [[5, 17, 42, 7, 99, 3, 61, 62], [11, 12, 13, 200, 8, 9]]
    variant = Variant(name="v", target="onnxruntime", quantize={"mode": "int4", **quantize_spec})
    quantized, _ = quantize(source, variant, calibration, folder)
    return residual_errors(source, quantized, calibration)


def test_layerwise_error_starts_at_the_first_quantized_block(tiny_artifacts, tmp_path):
    """Only layer 1's MLP quantized: the residual stream matches fp32 up to it, and it adds the error."""
    artifact = tiny_artifacts["llama"]
    records = _layerwise(artifact, tmp_path, exclude=["model.layers.0.*", "model.layers.1.self_attn.*", "lm_head"])

    assert [r["block"] for r in records] == ["model.layers.0.self_attn", "model.layers.0.mlp",
                                             "model.layers.1.self_attn", "model.layers.1.mlp", "lm_head"]
    assert all(r["relative_error"] < 1e-6 for r in records[:3])
    assert records[3]["relative_error"] > 1e-3 and records[3]["added"] == max(r["added"] for r in records)
    # The head is fp32: the logits carry the stream's error, and the head adds nothing to it.
    assert records[4]["point"] == "logits" and records[4]["relative_error"] > 1e-4 and abs(records[4]["added"]) < 1e-5
    assert not list((artifact / "variants" / "cpu-fp32").glob(".activations-*"))  # the graph copies are gone


@pytest.mark.parametrize("family_name, tied", [("llama", False), ("gemma", True)])
def test_layerwise_logits_row_shows_what_a_quantized_head_adds(tiny_artifacts, tmp_path, family_name, tied):
    """Only the LM head quantized: the stream matches fp32 everywhere, and the logits' error is the head's,
    for a head of its own and one tied to the embedding table (read through a Transpose)."""
    from compiler.weights import lm_head_weight

    artifact = tiny_artifacts[family_name]
    entry = json.loads((artifact / "manifest.json").read_text())["variants"]["cpu-fp32"]
    assert lm_head_weight(onnx.load(str(artifact / entry["model"]), load_external_data=False)).transposed is tied
    *stream, logits = _layerwise(artifact, tmp_path, exclude=["model.layers.*"], exact_top_logits=0)

    assert stream and all(r["relative_error"] < 1e-6 for r in stream)
    assert logits["point"] == "logits" and logits["relative_error"] > 1e-3
    assert abs(logits["added"] - logits["relative_error"]) < 1e-5
