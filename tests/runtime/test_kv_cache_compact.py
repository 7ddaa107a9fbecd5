"""Variants with `kv_cache: float16` and `kv_cache: int8`: compiled through the real pipeline on a tiny
Llama, their kernels' graphs keep the KV cache in fp16 (ai.kiln::GroupQueryAttentionFp16Cache) or in 8
bits with a scale a slot (GroupQueryAttentionInt8Cache), the runtime allocates and moves those caches, a
request's tokens do not depend on what shares its batch, and the memory plan counts the cache at its
size. Skipped where this machine cannot run Kiln's CPU kernels (the variant then runs model.onnx, whose
cache stays fp32)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from runtime import cpu_kernels
from runtime.artifact import Artifact
from runtime.generator import Generator
from runtime.memory import variant_plan
from runtime.sampling import SamplingParams
from tests.conftest import FP32_VARIANT, write_recipe
from tests.runtime.test_engine import _requests, _run_staggered

LIBRARY, WHY_NOT = cpu_kernels.library()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason=f"Kiln's CPU kernels: {WHY_NOT}")
HALF, EIGHT_BIT = "cpu-fp32-kv16", "cpu-fp32-kv8"
# variant: (its kernels' cache dtype, its attention op, its ONNX element type, bytes a slot of a head of d)
COMPACT = {HALF: (np.float16, cpu_kernels.ATTENTION_FP16_CACHE_OP, onnx.TensorProto.FLOAT16, lambda d: 2 * d),
           EIGHT_BIT: (np.int8, cpu_kernels.ATTENTION_INT8_CACHE_OP, onnx.TensorProto.INT8, lambda d: d + d // 4)}
compact = pytest.mark.parametrize("variant", list(COMPACT))


@pytest.fixture(scope="module")
def artifact(tiny_checkpoints, tmp_path_factory):
    from compiler.pipeline import compile_recipe

    root = tmp_path_factory.mktemp("kv-compact")
    recipe = write_recipe(root / "recipe.yaml", tiny_checkpoints["llama"], name="tiny-kv-compact",
                          variants=FP32_VARIANT + f"  - {{name: {HALF}, target: onnxruntime, kv_cache: float16}}\n"
                          f"  - {{name: {EIGHT_BIT}, target: onnxruntime, kv_cache: int8}}\n")
    return compile_recipe(recipe, root / "out")


@compact
def test_the_kernels_graph_holds_a_compact_cache_and_model_onnx_an_fp32_one(artifact, variant):
    dtype, op, element, slot_bytes = COMPACT[variant]
    opened = Artifact.open(artifact)
    entry, fp32 = opened.variant(variant), opened.variant("cpu-fp32")
    assert entry.kernel_kv_cache == np.dtype(dtype).name and fp32.kernel_kv_cache is None
    assert entry.document["kernel_accuracy"]["top1_agreement"] >= 0.98  # measured against eager, under the gates
    kernels = onnx.load(str(artifact / entry.kernel_model), load_external_data=False)
    attentions = [n for n in kernels.graph.node if n.domain == cpu_kernels.DOMAIN and "Attention" in n.op_type]
    assert attentions and {n.op_type for n in attentions} == {op}
    caches = [v for v in [*kernels.graph.input, *kernels.graph.output] if "key" in v.name or "value" in v.name]
    assert caches and {v.type.tensor_type.elem_type for v in caches} == {element}
    d = entry.interface.head_dim
    assert {v.type.tensor_type.shape.dim[3].dim_value for v in caches} == {slot_bytes(d) // np.dtype(dtype).itemsize}
    standard = onnx.load(str(artifact / entry.model), load_external_data=False)
    assert {v.type.tensor_type.elem_type for v in standard.graph.input if "key" in v.name} == {onnx.TensorProto.FLOAT}
    # The plan counts the cache the host holds, at its bytes a slot; on another provider, model.onnx's.
    plan = variant_plan(opened.manifest, entry, 8).kv_bytes_per_token
    assert plan * 4 * d == variant_plan(opened.manifest, fp32, 8).kv_bytes_per_token * slot_bytes(d)
    assert variant_plan(opened.manifest, fp32, 8).kv_bytes_per_token == \
        variant_plan(opened.manifest, entry, 8, providers=["CUDAExecutionProvider"]).kv_bytes_per_token


@compact
def test_bench_ab_step_runs_either_graph_of_the_variant(artifact, variant):
    from bench.ab_step import load

    for graph, dtype in (("model_kernels.onnx", COMPACT[variant][0]), ("model.onnx", np.float32)):
        backend = load(f"{artifact}:{variant}/{graph}", 1)
        cache = backend.new_cache(2, 8)
        assert cache[0].dtype == dtype
        logits, _ = backend.run(np.array([[3], [7]]), np.ones((2, 1), np.int64), np.zeros((2, 1), np.int64), cache)
        assert np.isfinite(logits).all()


@compact
def test_a_requests_tokens_do_not_depend_on_its_batch(artifact, variant):
    generator = Generator.load(artifact, variant)
    assert generator.backend.kv_dtype == COMPACT[variant][0]
    prompts, params = _requests(12, seed=3)
    alone = [generator.generate([p], q)[0].token_ids for p, q in zip(prompts, params, strict=True)]
    assert [r.token_ids for r in generator.generate(prompts, params)] == alone  # one burst, prefilled in place
    engine = generator.engine  # a server's policy, prompts in pieces, rows joining and leaving: caches moved
    engine.max_prefill_tokens, engine.max_batch_size, engine.prefill_first = 16, 5, False
    arrivals = sorted(np.random.default_rng(4).integers(0, 30, len(prompts)))
    results, _ = _run_staggered(engine, prompts, params, arrivals)
    assert [results[i].token_ids for i in range(len(prompts))] == alone


@compact
def test_beams_and_forks_copy_compact_rows(artifact, variant):
    generator = Generator.load(artifact, variant)
    prompt = [3, 17, 29, 41, 5]
    beams = SamplingParams(max_new_tokens=6, num_beams=3, ignore_eos=True)
    alone = generator.generate([prompt], beams)[0]
    beside = generator.generate([prompt, [9, 8, 7]], beams)[0]  # beams gather rows of the compact cache
    assert beside.token_ids == alone.token_ids
    forked = generator.generate([prompt], SamplingParams(max_new_tokens=5, n=3, seed=7, temperature=0.8))[0]
    again = generator.generate([prompt], SamplingParams(max_new_tokens=5, n=3, seed=7, temperature=0.8))[0]
    assert [forked.token_ids] + [a.token_ids for a in forked.alternatives] == \
        [again.token_ids] + [a.token_ids for a in again.alternatives]


@compact
def test_prefix_cache_copies_compact_blocks_and_answers_stay_the_same(artifact, variant):
    from tests.runtime.test_prefix_cache import PARAMS, _shared_prefix_prompts

    prompts = _shared_prefix_prompts(8, seed=5)
    reference = Generator.load(artifact, variant, prefix_cache_mib=0)
    expected = [reference.generate([p], PARAMS)[0].token_ids for p in prompts]
    generator = Generator.load(artifact, variant)
    assert [r.token_ids for r in generator.generate(prompts, PARAMS)] == expected
    later = generator.generate(prompts, PARAMS)
    assert [r.token_ids for r in later] == expected and all(r.cached_tokens for r in later)
    blocks = generator.engine.scheduler.prefix_cache.blocks
    assert blocks and all(array.dtype == COMPACT[variant][0] for block in blocks.values() for array in block)
