"""TensorRT variants: everything that runs without TensorRT, for real, and the GPU tests that need it.

On a host without TensorRT (every machine this project runs on) the engine build is skipped with its
reason; what is tested is the graph the engine would get, driven exactly as the engine would be (the
leading KV slot) under ONNX Runtime and held to gates, the profiles, the host checks and the refusals.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest

from compiler.accuracy import greedy
from compiler.errors import RecipeError
from compiler.pipeline import compile_recipe
from compiler.recipe import Profiles, default_profiles, load_recipe
from compiler.tensorrt_build import engine_profiles
from runtime.artifact import Artifact
from runtime.backends.onnxruntime import OnnxRuntimeBackend
from runtime.backends.onnxruntime_cuda import cuda_missing
from runtime.backends.registry import open_backend
from runtime.backends.tensorrt import ShapeOutsideProfiles, check_host, pick_profile
from runtime.errors import IncompatibleArtifact
from runtime.generator import Generator, left_padded
from runtime.manifest import Variant
from tests.conftest import write_recipe

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None
INTERFACE = {"layers": 2, "kv_heads": 2, "head_dim": 16, "vocab_size": 320,
             "inputs": [{"name": "input_ids"}, {"name": "attention_mask"}, {"name": "position_ids"},
                        {"name": "past_key_values.{layer}.key"}, {"name": "past_key_values.{layer}.value"}]}
VARIANTS = """\
  - {name: trt-fp32, target: tensorrt, gates: {top1_agreement: 1.0, greedy_match: 1.0, max_logit_error: 0.001},
     profiles: {batch: [1, 4, 16], prompt: [1, 16, 48], context: [1, 64, 128]}}
  - {name: trt-fp16, target: tensorrt, precision: fp16, gates: {top1_agreement: 0.97, perplexity_change: 0.01},
     engine: {optimization_level: 2, workspace_mib: 512}}
  - {name: trt-int8, target: tensorrt, quantize: {mode: int8-static}, gates: {top1_agreement: 0.6, perplexity_change: 0.1}}
"""


@pytest.fixture(scope="module")
def trt_artifact(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("tensorrt")
    recipe = write_recipe(root / "r.yaml", tiny_checkpoints["llama"], variants=VARIANTS,
                          extra="validate: {max_new_tokens: 8}\n")
    return compile_recipe(recipe, root / "artifact")


def test_profiles_from_recipe_values():
    prefill, decode = engine_profiles(Profiles(batch=[1, 4, 16], prompt=[1, 32, 64], context=[1, 128, 256]),
                                      INTERFACE)
    assert prefill["name"] == "prefill" and decode["name"] == "decode"
    assert prefill["shapes"]["input_ids"] == [[1, 1], [4, 32], [16, 64]]
    assert prefill["shapes"]["attention_mask"] == [[1, 2], [4, 33], [16, 65]]  # the leading slot + the prompt
    assert prefill["shapes"]["past_key_values.1.value"] == [[1, 2, 1, 16], [4, 2, 1, 16], [16, 2, 1, 16]]
    assert decode["shapes"]["input_ids"] == [[1, 1], [4, 1], [16, 1]]
    # past = slot + tokens already cached (1 .. context - 1); never a zero-length dimension
    assert decode["shapes"]["past_key_values.0.key"] == [[1, 2, 2, 16], [4, 2, 128, 16], [16, 2, 256, 16]]
    assert decode["shapes"]["attention_mask"] == [[1, 3], [4, 129], [16, 257]]
    assert len(prefill["shapes"]) == 3 + 4
    assert all(min(dim for shape in ranges for dim in shape) >= 1
               for p in (prefill, decode) for ranges in p["shapes"].values())


def test_default_profiles_fit_the_context():
    for context in (2, 128, 2048, 32768):
        profiles = default_profiles(context)
        assert profiles.context[2] == context and profiles.prompt[2] < context
        assert profiles.prompt[0] <= profiles.prompt[1] <= profiles.prompt[2]


@pytest.mark.parametrize("variant, message", [
    ("{name: t, target: tensorrt, profiles: {context: [1, 64, 4096]}}",
     "variants.t.profiles.context: max 4096 exceeds export.max_context 128"),
    ("{name: t, target: tensorrt, profiles: {prompt: [1, 64, 128], context: [1, 64, 128]}}",
     "variants.t.profiles.prompt: max 128 leaves no room to generate within context max 128"),
    ("{name: t, target: tensorrt, profiles: {prompt: [1, 1, 1], context: [1, 1, 1]}}",
     "variants.t.profiles.context: max must be at least 2"),
    ("{name: t, target: tensorrt, profiles: {batch: [0, 1, 8]}}", "variants.0.profiles.batch.0"),
    ("{name: t, target: onnxruntime, engine: {optimization_level: 3}}",
     "variants.0: engine: only tensorrt variants build engines"),
    ("{name: t, target: tensorrt, engine: {optimization_level: 9}}", "variants.0.engine.optimization_level"),
    ("{name: t, target: tensorrt, engine: {hardware_compatibility: turing_plus}}",
     "variants.0.engine.hardware_compatibility"),
])
def test_impossible_profiles_and_engine_settings_are_refused(variant, message, tiny_checkpoints, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"], variants=f"  - {variant}\n")
    with pytest.raises(RecipeError) as error:
        load_recipe(recipe)
    assert message in str(error.value)


def test_pick_profile_by_shape_and_refuse_what_fits_none():
    profiles = engine_profiles(Profiles(batch=[1, 4, 16], prompt=[1, 32, 64], context=[1, 128, 256]), INTERFACE)

    def shapes(batch: int, seq: int, past: int) -> dict:
        kv = {n: (batch, 2, past, 16) for n in profiles[0]["shapes"] if n.startswith("past")}
        return {"input_ids": (batch, seq), "attention_mask": (batch, past + seq), "position_ids": (batch, seq), **kv}

    assert pick_profile(profiles, shapes(3, 20, 1)) == 0  # prefill: only the leading slot in the cache
    assert pick_profile(profiles, shapes(3, 1, 1)) == 0  # a one-token prompt is a prefill too
    assert pick_profile(profiles, shapes(16, 1, 256)) == 1
    with pytest.raises(ShapeOutsideProfiles, match="input_ids dim 0 is 40, allowed 1..16"):
        pick_profile(profiles, shapes(40, 1, 30))
    with pytest.raises(ShapeOutsideProfiles, match="prefill: input_ids dim 1 is 65, allowed 1..64"):
        pick_profile(profiles, shapes(1, 65, 1))


ENGINE = {"tensorrt_version": "10.13.0.35", "compute_capability": "8.6", "gpu": "NVIDIA A10",
          "hardware_compatibility": "none", "version_compatible": False}


def test_host_checks_name_both_values():
    check_host(ENGINE, "10.13.0.40", "8.6")  # same release, another build number
    with pytest.raises(IncompatibleArtifact, match=r"built with TensorRT 10\.13\.0\.35, this host has TensorRT 10\.14\.1"):
        check_host(ENGINE, "10.14.1.2", "8.6")
    with pytest.raises(IncompatibleArtifact, match=r"compute capability 8\.6 \(NVIDIA A10\), this GPU \(Tesla T4\) is 7\.5"):
        check_host(ENGINE, "10.13.0.35", "7.5", "Tesla T4")
    with pytest.raises(IncompatibleArtifact, match="compute capability 8.6"):
        check_host(ENGINE, "10.13.0.35", "8.9")  # an engine for one architecture only
    portable = {**ENGINE, "version_compatible": True, "hardware_compatibility": "ampere_plus"}
    check_host(portable, "11.4.0.106", "8.9")  # later TensorRT, newer GPU
    with pytest.raises(IncompatibleArtifact, match="version-compatible: that release or a later one"):
        check_host(portable, "10.12.0.1", "8.6")
    with pytest.raises(IncompatibleArtifact, match="this host has TensorRT 12.0.0"):
        check_host(portable, "12.0.0", "8.6")  # across majors only 8 -> 10 and 10 -> 11
    with pytest.raises(IncompatibleArtifact, match=r"8\.0 or newer \(ampere_plus\)"):
        check_host(portable, "11.4.0.106", "7.5")


def test_tensorrt_variants_are_skipped_with_the_reason_and_validated_as_driven(trt_artifact):
    manifest = json.loads((trt_artifact / "manifest.json").read_text())
    for name in ("trt-fp32", "trt-fp16", "trt-int8"):
        entry = manifest["variants"][name]
        assert entry["status"] == "skipped" and "engine" not in entry, name
        assert entry["reason"].startswith("TensorRT is not installed on this host") or \
            entry["reason"].startswith("TensorRT does not load on this host"), entry["reason"]
        assert entry["interface"]["leading_kv_slot"] is True
        profiles = json.loads((trt_artifact / "variants" / name / "profiles.json").read_text())
        assert [p["name"] for p in profiles] == ["prefill", "decode"]
        report = json.loads((trt_artifact / "reports" / f"{name}.json").read_text())
        assert report["passed"] and report["gates"] == entry["gates"], name  # the graph met its gates under ORT
    assert manifest["variants"]["trt-fp32"]["profiles"]["batch"] == [1, 4, 16]
    assert manifest["variants"]["trt-fp16"]["profiles"] == default_profiles(128).model_dump()
    exact = json.loads((trt_artifact / "reports" / "trt-fp32.json").read_text())["summary"]
    assert exact["greedy_match"] == 1.0 and exact["max_logit_error"] < 1e-3


def test_leading_slot_changes_nothing_the_model_computes(trt_artifact):
    entry = json.loads((trt_artifact / "manifest.json").read_text())["variants"]["trt-fp32"]
    path = trt_artifact / entry["model"]
    with_slot = OnnxRuntimeBackend(path, entry["interface"])
    plain = OnnxRuntimeBackend(path, {**entry["interface"], "leading_kv_slot": False})
    prompts = [[5, 9, 17, 33], [7], [11, 12, 13, 14, 15, 16, 17]]
    tokens_slot, prefill_slot = greedy(with_slot, prompts, 12, 0)
    tokens_plain, prefill_plain = greedy(plain, prompts, 12, 0)
    assert tokens_slot == tokens_plain
    np.testing.assert_allclose(prefill_slot, prefill_plain, atol=1e-5)
    ids, mask = left_padded(prompts, 0)
    cache = with_slot.new_cache(3, 20)
    assert cache[0].shape[2] == 1  # the slot, so no input is ever zero-length


def test_compile_strict_fails_when_an_engine_cannot_be_built(tiny_checkpoints, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"],
                          variants="  - {name: cpu-fp32, target: onnxruntime}\n  - {name: gpu, target: tensorrt}\n",
                          extra="validate: {max_new_tokens: 4}\n")
    result = subprocess.run([sys.executable, "-m", "compiler.cli", str(recipe), "--out", str(tmp_path / "out"),
                             "--strict"], capture_output=True, text=True)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("compile-model: error: --strict: engines not built: gpu: TensorRT")
    assert not (tmp_path / "out").exists()


def test_run_model_on_a_skipped_engine_fails_in_one_line(trt_artifact):
    result = subprocess.run([sys.executable, "-m", "runtime.cli", str(trt_artifact), "--variant", "trt-fp16",
                             "--prompt", "hi"], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "variant 'trt-fp16' was not built: TensorRT is not installed" in result.stderr or \
        "variant 'trt-fp16' was not built: TensorRT does not load" in result.stderr


@pytest.mark.skipif(HAS_TENSORRT, reason="checks the refusal on a host without TensorRT")
def test_engine_backend_without_tensorrt_is_one_clear_error(trt_artifact):
    entry = Artifact.open(trt_artifact).manifest.variants["trt-fp32"]
    engine_entry = Variant.of(entry.name, {**entry.document, "engine": {**ENGINE, "file": "variants/trt-fp32/engine.plan"}})
    with pytest.raises(IncompatibleArtifact, match="this variant is a TensorRT engine and this host cannot run it"):
        open_backend(trt_artifact, engine_entry)


def test_importing_compiler_and_runtime_needs_no_tensorrt():
    code = ("import sys, runtime.backends.tensorrt, runtime.generator, compiler.tensorrt_build, compiler.pipeline;"
            "assert 'tensorrt' not in sys.modules and 'polygraphy' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(HAS_TENSORRT or cuda_missing() is None, reason="checks the refusal on a host with no GPU path")
def test_gpu_check_script_refuses_this_host_in_one_line():
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip() == result.stderr.strip().splitlines()[0]
    assert result.stderr.startswith("gpu-check: no GPU path runs on this host (onnxruntime-cuda: ")
    assert "tensorrt: TensorRT" in result.stderr


# -- on a GPU host with TensorRT ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TENSORRT, reason="needs TensorRT and an NVIDIA GPU")
def test_engines_build_and_decode_like_eager(tiny_checkpoints, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_checkpoints["llama"], variants=VARIANTS,
                          extra="validate: {max_new_tokens: 8}\n")
    artifact = compile_recipe(recipe, tmp_path / "artifact", strict=True)
    manifest = json.loads((artifact / "manifest.json").read_text())
    for name in ("trt-fp32", "trt-fp16", "trt-int8"):
        entry = manifest["variants"][name]
        assert entry["status"] == "built" and (artifact / entry["engine"]["file"]).stat().st_size > 0
        assert entry["engine"]["compute_capability"] and entry["engine"]["tensorrt_version"]
    prompts = ["The quick brown", "Paris is", "def add(a, b):"]
    reference = Generator.load(artifact, "trt-fp32").generate(prompts)
    from runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine = [r.token_ids for r in Generator.load(artifact, "trt-fp32").generate(prompts, params)]
    graph = Generator(Artifact.open(artifact), OnnxRuntimeBackend(
        artifact / manifest["variants"]["trt-fp32"]["model"], manifest["variants"]["trt-fp32"]["interface"]),
        Generator.load(artifact, "trt-fp32").tokenizer)
    assert engine == [r.token_ids for r in graph.generate(prompts, params)]
    assert all(r.error is None for r in reference)
