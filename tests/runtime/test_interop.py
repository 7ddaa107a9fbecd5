"""A variant folder opens as it is in onnxruntime-genai (its greedy tokens equal Kiln's) and in
transformers (config and tokenizer); `kiln export-for` writes such a folder for any artifact; `kiln
inspect --polygraphy-shapes` is an argument polygraphy runs with. Optimum needs transformers < 4.58:
scripts/interop-check runs it in its own virtual environment."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.artifact import Artifact
from runtime.generator import Generator
from runtime.interop import input_shapes, parse_sizes
from runtime.sampling import SamplingParams
from tests.conftest import genai_greedy

pytest.importorskip("onnxruntime_genai")

PROMPTS = ["The quick brown fox", "A KV cache keeps the keys and values of earlier tokens. Prefill runs",
           "def add(a, b):", "Paris is the capital of"]
VARIANTS = ("cpu-fp32", "cpu-fp32-unfused")  # the GroupQueryAttention graph and the plain one
NEW_TOKENS = 16


def _kiln(*args):
    return subprocess.run([sys.executable, "-m", "runtime.kiln_cli", *map(str, args)], capture_output=True, text=True)


def test_genai_opens_each_variant_folder_with_kilns_greedy_tokens(tiny_artifacts, family):
    artifact = tiny_artifacts[family]
    for variant in VARIANTS:
        generator = Generator.load(artifact, variant)
        prompts = [generator.encode(p) for p in PROMPTS]
        kiln = [r.token_ids for r in generator.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))]
        assert genai_greedy(artifact / "variants" / variant, prompts, NEW_TOKENS) == kiln, variant


def test_genai_batch_of_prompts_of_different_lengths_gets_each_rows_own_tokens(tiny_artifacts, tiny_checkpoints,
                                                                             family):
    """onnxruntime-genai feeds a batch right-padded; a `logits: last` graph must give each row its own
    last token's logits, not the last column's (which is a pad in the shorter rows). Sliding-window
    families are left out: genai's decode steps keep a shorter row's pads between its prompt and its
    new tokens, inside the window's slots (a known limit, docs/interop.md)."""
    import numpy as np
    import onnxruntime_genai as og

    folder = tiny_artifacts[family] / "variants" / "cpu-fp32"
    from transformers import AutoConfig

    from compiler.families import shapes_of

    if shapes_of(AutoConfig.from_pretrained(tiny_checkpoints[family])).sliding_window:
        pytest.skip(f"{family} has a sliding window: onnxruntime-genai's batched rows step outside the window's "
                    "slots (a known limit, docs/interop.md)")
    generator = Generator.load(tiny_artifacts[family], "cpu-fp32")
    prompts = [generator.encode(p) for p in PROMPTS]
    alone = [r.token_ids for r in generator.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))]
    width = max(map(len, prompts))
    params = og.GeneratorParams(model := og.Model(str(folder)))
    params.set_search_options(max_length=width + NEW_TOKENS, do_sample=False, batch_size=len(prompts))
    batch = og.Generator(model, params)
    pad = json.loads((folder / "genai_config.json").read_text())["model"]["pad_token_id"]  # genai masks by it
    batch.append_tokens(np.array([p + [pad] * (width - len(p)) for p in prompts], np.int32))
    tokens = [[] for _ in prompts]
    for _ in range(NEW_TOKENS):
        batch.generate_next_token()
        for row, token in enumerate(batch.get_next_tokens()):
            if not tokens[row] or tokens[row][-1] != 0:  # after EOS (0) a row only repeats it
                tokens[row].append(int(token))
    assert tokens == alone


def test_sidecars_are_listed_hashed_and_read_by_transformers(tiny_artifacts, tiny_checkpoints, family):
    from transformers import AutoConfig, AutoTokenizer

    opened = Artifact.open(tiny_artifacts[family])
    files = opened.manifest.files
    original = AutoConfig.from_pretrained(tiny_checkpoints[family])
    for variant in VARIANTS:
        sidecars = opened.manifest.variants[variant].sidecars
        assert {f"variants/{variant}/{n}" for n in ("config.json", "genai_config.json", "tokenizer.json")} <= \
            set(sidecars) <= set(files)
        folder = opened.folder / "variants" / variant
        config = AutoConfig.from_pretrained(folder)
        assert getattr(config, "rope_parameters", None) == getattr(original, "rope_parameters", None)
        assert (config.num_hidden_layers, config.vocab_size) == (original.num_hidden_layers, original.vocab_size)
        written = json.loads((folder / "config.json").read_text())
        rope = getattr(original, "rope_parameters", None) or {}
        if "rope_theta" in rope:  # what transformers 4.x reads: the base (and fraction) at the top level
            theta_key, fraction_key = ("rotary_emb_base", "rotary_pct") if family == "gpt_neox" else \
                ("rope_theta", "partial_rotary_factor")
            assert written[theta_key] == rope["rope_theta"]
            assert written.get(fraction_key) == rope.get("partial_rotary_factor")
            # 4.x reads any scaling from rope_scaling: none for default rotary; GPT-OSS's yarn parameters, as
            # its own checkpoints' config.json has them (its graph computes cos and sin, so genai_config has none)
            scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
            assert written["rope_scaling"] == (None if rope.get("rope_type", "default") == "default" else scaling)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == \
            "PreTrainedTokenizerFast"
        generator = Generator.load(opened.folder, variant)
        assert tokenizer(PROMPTS[1]).input_ids == generator.encode(PROMPTS[1])


def own_copy(artifact: Path, tmp_path: Path) -> Path:
    """A copy of a shared artifact for a test that exports from it: export-for hard-links the artifact's
    files, and onnx refuses to read external data from a file with more than one link (a hardlink attack,
    as onnx sees it), which a later test quantizing the shared artifact's graph would meet."""
    return shutil.copytree(artifact, tmp_path / f"{artifact.name}-own")


def test_export_for_writes_a_folder_the_tool_opens(tiny_artifacts, tmp_path):
    artifact = own_copy(tiny_artifacts["qwen2"], tmp_path)
    out = tmp_path / "genai"
    result = _kiln("export-for", "genai", f"{artifact}:cpu-fp32-unfused", out)
    assert result.returncode == 0, result.stderr
    kernels = ["model_kernels.onnx"] * (Artifact.open(artifact).variant("cpu-fp32-unfused").kernel_model is not None)
    assert sorted(p.name for p in out.iterdir()) == sorted(  # the kernels' graph, for its fp32 MatMuls, goes along
        ["model.onnx", "model.onnx.data", "genai_config.json", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja", "generation_config.json", *kernels])
    generator = Generator.load(artifact, "cpu-fp32-unfused")
    prompts = [generator.encode(p) for p in PROMPTS[:2]]
    kiln = [r.token_ids for r in generator.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS))]
    assert genai_greedy(out, prompts, NEW_TOKENS) == kiln
    assert json.loads((out / "genai_config.json").read_text())["search"]["past_present_share_buffer"] is False
    optimum = tmp_path / "optimum"
    assert _kiln("export-for", "optimum", artifact, optimum, "--copy").returncode == 0
    assert (optimum / "config.json").is_file() and not (optimum / "genai_config.json").exists()
    assert (optimum / "model.onnx").stat().st_ino != (artifact / "variants/cpu-fp32/model.onnx").stat().st_ino
    # A folder that is not empty is refused, whole, and left as it was.
    again = _kiln("export-for", "genai", artifact, out)
    assert again.returncode == 1 and "already exists and is not an empty folder" in again.stderr
    assert len(list(out.iterdir())) == 7 + len(kernels) and not list(tmp_path.glob(".genai.partial-*"))


def test_export_for_optimum_refuses_what_optimum_cannot_run(tiny_artifacts, tmp_path):
    """Optimum 2.1 sizes a phi3 model's cache from num_attention_heads (scripts/interop-check shows it fail)."""
    result = _kiln("export-for", "optimum", tiny_artifacts["phi3"], tmp_path / "out")
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1
    assert "KV cache as 4 heads x 16 from its config, this graph's is 2 x 16" in result.stderr
    assert not (tmp_path / "out").exists()
    described = _kiln("inspect", tiny_artifacts["phi3"]).stdout
    assert "opens in   onnxruntime-genai (og.Model)" in described and "not in     Optimum 2.1" in described
    assert _kiln("export-for", "optimum", own_copy(tiny_artifacts["llama"], tmp_path), tmp_path / "llama").returncode == 0


def test_export_for_an_artifact_compiled_before_sidecars(tiny_artifacts, tmp_path):
    """An older artifact (no sidecars, no config in the manifest, a transformers-5-only tokenizer config)."""
    copy = shutil.copytree(tiny_artifacts["llama"], tmp_path / "old")
    manifest = json.loads((copy / "manifest.json").read_text())
    for entry in manifest["variants"].values():
        for relative in entry.pop("sidecars"):
            (copy / relative).unlink()
            del manifest["files"][relative]
    manifest["model"].pop("config")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = _kiln("export-for", "optimum", copy, tmp_path / "out")
    assert result.returncode == 1
    assert "compiled before Kiln recorded the model's config" in result.stderr and "recompile" in result.stderr
    assert not (tmp_path / "out").exists()
    assert _kiln("export-for", "genai", f"{copy}:cpu-fp32", tmp_path / "genai").returncode == 1
    assert "opens in   kiln export-for" in _kiln("inspect", copy).stdout


def test_polygraphy_runs_with_the_printed_shapes(tiny_artifacts):
    polygraphy = Path(sys.executable).with_name("polygraphy")
    if not polygraphy.is_file():
        pytest.skip("polygraphy is not installed (the test extra has it)")
    artifact = tiny_artifacts["llama"]
    for variant, sizes in (("cpu-fp32", "batch=2,seq=8,past=0"), ("cpu-fp32", "batch=2,seq=1,past=7"),
                           ("cpu-fp32-unfused", "batch=2,seq=8,past=3")):
        printed = _kiln("inspect", f"{artifact}:{variant}", "--polygraphy-shapes", sizes)
        assert printed.returncode == 0, printed.stderr
        model = artifact / "variants" / variant / "model.onnx"
        run = subprocess.run([str(polygraphy), "run", str(model), "--onnxrt", *shlex.split(printed.stdout)],
                             capture_output=True, text=True)
        assert run.returncode == 0 and "PASSED" in run.stdout + run.stderr, run.stdout + run.stderr
    trtexec = _kiln("inspect", f"{artifact}:cpu-fp32-unfused", "--trtexec-shapes", "batch=1,seq=1,past=4").stdout
    assert trtexec.startswith("--shapes=input_ids:1x1,attention_mask:1x5,position_ids:1x1,"
                              "past_key_values.0.key:1x2x4x16,past_key_values.0.value:1x2x4x16,")


@pytest.mark.parametrize(("sizes", "error"), [
    ("batch=1,seq=8", "missing size 'past'"),
    ("batch=1,seq=8,past=0,beam=2", "unknown size 'beam'"),
    ("batch=one", "'batch=one' is not NAME=NUMBER"),
    ("batch=2,seq=4,past=4", "only at batch 1"),
    ("batch=1,seq=4,past=4,capacity=6", "capacity 6 is under past + seq = 8"),
])
def test_bad_sizes_say_what_to_write(tiny_artifacts, sizes, error):
    interface = Artifact.open(tiny_artifacts["llama"], verify=False).variant("cpu-fp32").interface
    with pytest.raises(ValueError, match=re.escape(error)):
        input_shapes(interface, parse_sizes(sizes))
    result = _kiln("inspect", f"{tiny_artifacts['llama']}:cpu-fp32", "--polygraphy-shapes", sizes)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1 and error.split("'")[0] in \
        result.stderr


def test_inspect_describes_the_variant(tiny_artifacts):
    result = _kiln("inspect", tiny_artifacts["mistral"])
    assert result.returncode == 0, result.stderr
    assert "tiny-mistral:cpu-fp32 (onnxruntime, fp32, fused), built" in result.stdout
    assert "past_key_values.0..1.key float32 [batch, 1, capacity, 16]" in result.stdout
    assert "onnxruntime-genai" in result.stdout
    entry = json.loads(_kiln("inspect", f"{tiny_artifacts['mistral']}:cpu-fp32-unfused", "--json").stdout)
    assert entry["name"] == "cpu-fp32-unfused" and entry["interface"]["kv_sharing"] == "none"
