"""The backend registry: which kind runs a manifest entry, opening one through it, and the protocol."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.artifact import Artifact
from runtime.backends import Backend, kind_of, open_backend, runnable_variant
from runtime.backends.registry import KINDS, host_fit, memory_on_host, opens_in_other_tools
from runtime.errors import IncompatibleArtifact
from runtime.manifest import Variant


def entry(**keys) -> Variant:
    return Variant.of("v", {"status": "built", **keys})


def test_an_entry_with_an_engine_is_tensorrts_and_one_with_a_graph_onnxruntimes():
    assert kind_of(entry(engine={}, model="variants/v/model.onnx")).name == "tensorrt"
    assert kind_of(entry(model="variants/v/model.onnx", target="tensorrt")).name == "onnxruntime"
    assert not memory_on_host(entry(engine={})) and memory_on_host(entry(model="m"))
    assert not memory_on_host(entry(model="m"), ["CUDAExecutionProvider"])
    # a TensorRT variant's graph (compiled without a GPU: no engine yet) is no graph for other tools
    assert not opens_in_other_tools(entry(model="m", target="tensorrt"))
    assert opens_in_other_tools(entry(model="m", target="onnxruntime"))


def test_an_entry_naming_no_file_is_refused_in_one_line():
    with pytest.raises(IncompatibleArtifact) as refused:
        kind_of(entry())
    assert "\n" not in str(refused.value) and "'engine' or 'providers' or 'model'" in str(refused.value)


def test_every_kind_has_the_functions_the_registry_calls():
    for kind in KINDS:
        module = kind.load()
        for function in ("open_variant", "refusal", "served_interface", "host_fit"):
            assert callable(getattr(module, function)), (kind.name, function)


def test_an_engine_on_a_host_without_tensorrt_does_not_fit():
    engine = entry(target="tensorrt", model="m",
                   engine={"file": "e.plan", "tensorrt_version": "10.8.0", "compute_capability": "9.0"})
    fit = host_fit("gpu-fp16", engine, None)
    assert fit.target == "tensorrt" and not fit.fits


def test_a_backend_opened_through_the_registry_follows_the_protocol_and_closes(tiny_artifacts):
    """The registry's backend runs a prompt and a decode step, and `with` lets its session go."""
    artifact = Artifact.open(tiny_artifacts["llama"])
    entry = runnable_variant(artifact)
    with open_backend(artifact.folder, entry, threads=1) as backend:
        assert isinstance(backend, Backend)
        cache = backend.new_cache(1, 16)
        ids = np.array([[1, 2, 3]], np.int64)
        logits, cache = backend.run(ids, np.ones((1, 3), np.int64), np.arange(3)[None], cache)
        assert logits.shape[-1] == backend.vocab_size and np.isfinite(logits).all()
        step, cache = backend.run(np.array([[4]], np.int64), np.ones((1, 4), np.int64), np.array([[3]]), cache)
        assert cache.length == 4 and np.isfinite(step).all()
    assert backend.session is None
