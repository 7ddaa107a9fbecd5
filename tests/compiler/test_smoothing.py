"""SmoothQuant folded into a real compiled graph: the same logits in fp32, fewer int8 losses."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from compiler.graph import OnnxArtifact
from compiler.smoothing import smooth


def _logits(model_path, interface, ids):
    from runtime.backends.onnxruntime import OnnxRuntimeBackend

    backend = OnnxRuntimeBackend(model_path, interface)
    cache = backend.new_cache(1, len(ids) + 1)
    logits, _ = backend.run(np.array([ids]), np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None], cache)
    return np.array(logits)


def _smoothed(artifact, variant, tmp_path):
    """Smooth a compiled variant's graph (alpha 0.5): its report, the initializers it changed, and the
    logits of the graph before and after on one prompt."""
    entry = json.loads((artifact / "manifest.json").read_text())["variants"][variant]
    source = OnnxArtifact((artifact / entry["model"]).parent, entry["interface"], None, 0)
    proto = onnx.load(str(source.model_path))
    before = {i.name: onnx.numpy_helper.to_array(i).copy() for i in proto.graph.initializer}
    report = smooth(proto, source, [[5, 17, 42, 7, 99, 3], [11, 12, 13, 200, 8]], 0.5, tmp_path / "work")
    changed = [i.name for i in proto.graph.initializer
               if i.name not in before or not np.array_equal(onnx.numpy_helper.to_array(i), before[i.name])]
    smoothed = tmp_path / "smoothed.onnx"
    onnx.save(proto, str(smoothed), save_as_external_data=True, location="smoothed.onnx.data")
    ids = [3, 14, 15, 92, 65, 35, 89]
    return report, changed, _logits(source.model_path, entry["interface"], ids), _logits(smoothed, entry["interface"], ids)


@pytest.mark.parametrize(("variant", "folded"), [
    ("cpu-fp32", {"norm scales": 4, "up_proj columns": 0, "v_proj columns": 2}),  # 2 layers, 2 norms each
    ("cpu-fp32-unfused", {"norm scales": 0, "up_proj columns": 2, "v_proj columns": 0})])
def test_smoothing_moves_ranges_into_weights_without_changing_the_logits(tiny_artifacts, tmp_path, variant, folded):
    """Fused graphs fold the factors into the RMSNorm scales and, through GroupQueryAttention (4 query
    heads on 2 kv heads: a factor per kv channel, repeated for each query head reading it), into
    v_proj's columns; unfused ones (no norm op) into up_proj's columns before the SiLU product. Either
    way the fp32 graph computes the same logits (float rounding apart), and the smoothed weights and
    scales did change."""
    report, changed, want, got = _smoothed(tiny_artifacts["llama"], variant, tmp_path)

    assert report["folded_into"] == folded
    assert changed
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert not (tmp_path / "work").exists()  # the graph copy read for ranges is gone, and its folder


def test_smoothing_keeps_every_familys_logits(tiny_artifacts, family, tmp_path):
    """Each family's fused fp32 graph, smoothed wherever the folds find a place (none for LayerNorm
    families, v_proj where attention reads it directly), computes the same logits."""
    report, _, want, got = _smoothed(tiny_artifacts[family], "cpu-fp32", tmp_path)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    if family in ("llama", "mistral", "gemma", "granite"):  # RMSNorm and GQA reading v_proj: both folds found
        assert report["folded_into"]["norm scales"] == 4 and report["folded_into"]["v_proj columns"] == 2


def test_smoothing_is_for_the_int8_modes_only():
    from pydantic import ValidationError

    from compiler.recipe import QuantizeSpec

    assert QuantizeSpec(mode="int8-dynamic", smoothing=0.5).smoothing == 0.5
    assert QuantizeSpec(mode="int8-static", smoothing=0.8).smoothing == 0.8
    with pytest.raises(ValidationError, match="smoothing applies to modes int8-dynamic and int8-static; int4 keeps"):
        QuantizeSpec(mode="int4", smoothing=0.5)
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        QuantizeSpec(mode="int8-dynamic", smoothing=1.5)
