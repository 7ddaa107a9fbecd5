"""Fixtures: tiny random-weight checkpoints of every supported family, saved as real HF folders
(config.json, model.safetensors, tokenizer.json, generation_config.json), and their compiled artifacts."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]

# scripts/docker-check, started when the session's tests are collected and read by tests/test_docker.py:
# it waits on apt, pip and Docker far more than on the CPU, so it runs beside the rest of the suite,
# niced, instead of adding its minutes after them.
DOCKER_CHECK = pytest.StashKey[tuple[subprocess.Popen, Path]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(item.nodeid.startswith("tests/test_docker.py") for item in session.items):
        return
    import tempfile

    descriptor, name = tempfile.mkstemp(prefix="kiln-docker-check-", suffix=".log")
    log = Path(name)
    with os.fdopen(descriptor, "w") as output:
        process = subprocess.Popen(["nice", "-n", "10", "bash", str(ROOT / "scripts" / "docker-check")], cwd=ROOT,
                                   stdout=output, stderr=subprocess.STDOUT)
    session.config.stash[DOCKER_CHECK] = (process, log)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A docker check still running (its test deselected by -x, say) is stopped: it stops its dockerd."""
    process, _ = session.config.stash.get(DOCKER_CHECK, (None, None))
    if process is not None and process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(120)

VOCAB = 320
EOS = 0
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A KV cache keeps the keys and values of earlier tokens.",
    "Prefill runs the whole prompt; decode runs one token at a time.",
    "def add(a, b): return a + b",
    "Paris is the capital of France. Berlin is the capital of Germany.",
] * 20

# Each family in compiler.families.FAMILIES needs a tiny config here (test_families checks).
# Shapes are small but keep each family's quirks: GQA for Llama/Mistral/Qwen2, a short sliding
# window for Mistral (so validation crosses it), QKV bias for Qwen2, learned positions for GPT-2.
_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256)
TINY_CONFIGS = {
    "llama": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)),
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                                      sliding_window=8)),
    "qwen2": ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    "qwen3": ("Qwen3Config", dict(_BASE, num_key_value_heads=2, head_dim=16)),
    "phi3": ("Phi3Config", dict(_BASE, num_key_value_heads=2, pad_token_id=EOS)),
    "phi": ("PhiConfig", dict(_BASE, partial_rotary_factor=0.5)),
    "gemma": ("GemmaConfig", dict(_BASE, num_key_value_heads=1, head_dim=16)),
    # Caps small enough that tanh bends these small random scores and logits: the cap matters.
    "gemma2": ("Gemma2Config", dict(_BASE, num_key_value_heads=2, head_dim=16, sliding_window=8,
                                    attn_logit_softcapping=0.05, final_logit_softcapping=0.5,
                                    query_pre_attn_scalar=16)),
    "gpt_neox": ("GPTNeoXConfig", dict(_BASE, rotary_pct=0.25)),
    "falcon": ("FalconConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
                                    new_decoder_architecture=True, max_position_embeddings=256)),
    "olmo": ("OlmoConfig", dict(_BASE, num_key_value_heads=2)),
    "olmo2": ("Olmo2Config", dict(_BASE, num_key_value_heads=2)),
    "stablelm": ("StableLmConfig", dict(_BASE, num_key_value_heads=2, partial_rotary_factor=0.25)),
    "granite": ("GraniteConfig", dict(_BASE, num_key_value_heads=2, embedding_multiplier=3.0,
                                      residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0)),
    "starcoder2": ("Starcoder2Config", dict(_BASE, num_key_value_heads=2, sliding_window=8)),
    # Mixture of experts: 4 experts, 2 a token, softmax routing renormalized (ONNX Runtime's MoE op).
    "mixtral": ("MixtralConfig", dict(_BASE, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
}
# Families in the table that are refused, with a tiny config that shows the refusal.
REFUSED_CONFIGS = {
    "bloom": ("BloomConfig", dict(hidden_size=64, n_layer=2, n_head=4)),
    "mpt": ("MptConfig", dict(d_model=64, n_layers=2, n_heads=4, max_seq_len=256)),
}
# Mixtures of experts without a row (top-2 of 4 to 8 experts), compiled by the generic path
# (compiler/families.py generic_family) and held to every family-parametrized test like Mixtral:
# Qwen2-MoE (a shared expert behind a sigmoid gate, not renormalized), Qwen3-MoE (renormalized, q/k
# norms), OLMoE (not renormalized, q/k norms), PhiMoE (its sparse-mixer router, LayerNorm) and GPT-OSS.
MOE_GENERIC_CONFIGS = {
    "qwen2_moe": ("Qwen2MoeConfig", dict(_BASE, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=48)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(_BASE, num_key_value_heads=2, head_dim=16, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(_BASE, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)),
    "phimoe": ("PhimoeConfig", dict(_BASE, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    # GPT-OSS: biased experts stored transposed and interleaved, a clamped SwiGLU (alpha 1.702, +1 on the up
    # half), softmax over the top-k logits, attention sinks, alternating sliding-window layers.
    "gpt_oss": ("GptOssConfig", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                     max_position_embeddings=256)),
}
# Model types with no row, compiled by the generic path: Helium (interleaved rotary, RMSNorm epsilon
# 1e-8), SmolLM3 (rotary skipped on some layers), two whose configs name their sizes the old way (n_embd,
# n_layer, n_head, n_positions): GPT-J (interleaved partial rotary, parallel attention and MLP) and
# GPTBigCode (StarCoder 1: multi-query attention), and the mixtures of experts above.
GENERIC_CONFIGS = {
    "helium": ("HeliumConfig", dict(_BASE, num_key_value_heads=2, head_dim=16, pad_token_id=EOS)),
    "smollm3": ("SmolLM3Config", dict(_BASE, num_key_value_heads=2, pad_token_id=EOS, no_rope_layer_interval=2)),
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, rotary_dim=8)),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, multi_query=True)),
    **MOE_GENERIC_CONFIGS,
}
# The families the family-parametrized tests run (the `family` fixture, tiny_checkpoints, tiny_artifacts):
# the table's rows and the mixtures of experts the generic path compiles.
FAMILY_CONFIGS = {**TINY_CONFIGS, **MOE_GENERIC_CONFIGS}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def long_context_llama(folder: Path) -> Path:
    """A tiny random-weight Llama with a 2,048-token context (so a long request decodes for seconds),
    saved with its tokenizer in folder; the server tests and scripts/docker_check.py serve it."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, bos_token_id=EOS, eos_token_id=EOS, hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    build_tokenizer(folder)
    return folder


SERVE_MODEL = "tiny-serve"


@pytest.fixture(scope="session")
def serve_artifact(tmp_path_factory) -> Path:
    """long_context_llama compiled (fp32): a long request decodes for seconds, time enough for a client to
    disconnect or another to find the queue full while it runs, and room for long structured answers."""
    from compiler.pipeline import compile_recipe

    root = tmp_path_factory.mktemp("serve")
    long_context_llama(root / "checkpoint")
    recipe = root / "serve.yaml"
    recipe.write_text(f'name: {SERVE_MODEL}\nmodel: {{source: "{root / "checkpoint"}"}}\n'
                      "export: {opset: 18, max_context: 2048, logits: last}\n"
                      "variants:\n  - {name: cpu-fp32, target: onnxruntime}\n")
    return compile_recipe(recipe, root / SERVE_MODEL)


def build_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def build_tiny_checkpoint(family: str, folder: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    class_name, kwargs = {**TINY_CONFIGS, **REFUSED_CONFIGS, **GENERIC_CONFIGS}[family]
    config = getattr(transformers, class_name)(vocab_size=VOCAB, bos_token_id=EOS, eos_token_id=EOS, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def genai_greedy(folder: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """onnxruntime-genai's greedy tokens for each prompt alone, from a folder it opens as it is."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    out = []
    for ids in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + new_tokens, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        tokens = []
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        out.append(tokens)
    return out


FP32_VARIANT = "  - {name: cpu-fp32, target: onnxruntime}\n"
UNFUSED_VARIANT = "  - {name: cpu-fp32-unfused, target: onnxruntime, fuse: false}\n"


def as_bf16(x: np.ndarray) -> np.ndarray:
    """An fp32 array rounded to bf16 (to nearest, ties to even), as fp32: what Kiln's bf16 kernel rounds."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)


def write_recipe(path: Path, source: Path | str, name: str = "tiny", extra: str = "",
                 variants: str = FP32_VARIANT) -> Path:
    path.write_text(
        f"name: {name}\n"
        f"model: {{source: \"{source}\"}}\n"
        "export: {opset: 18, max_context: 128, logits: last}\n"
        "variants:\n" + variants + extra
    )
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: build_tiny_checkpoint(family, root / family) for family in FAMILY_CONFIGS}


def compile_tiny(family: str, checkpoint: Path, root: Path) -> Path:
    """One family's tiny checkpoint through the real pipeline (its fp32 variants) into root."""
    from compiler.pipeline import compile_recipe

    recipe = write_recipe(root / f"{family}.yaml", checkpoint, name=f"tiny-{family}",
                          variants=FP32_VARIANT + UNFUSED_VARIANT)
    return compile_recipe(recipe, root / f"tiny-{family}")


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_checkpoints, tmp_path_factory) -> dict[str, Path]:
    """Each family compiled once through the real pipeline, shared by compiler and runtime tests. The
    families compile in processes of their own, one a core: a compile runs on one core, and 16 of them
    one after another were the suite's longest wait (338 s in CI; 4 families 80 s alone, 41 s two at
    a time)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    root = tmp_path_factory.mktemp("artifacts")
    families = list(tiny_checkpoints)
    workers = max(1, min(len(families), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        built = pool.map(compile_tiny, families, [tiny_checkpoints[f] for f in families], [root] * len(families))
        return dict(zip(families, built, strict=True))


@pytest.fixture(params=sorted(FAMILY_CONFIGS))
def family(request) -> str:
    return request.param


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (mount's -o size=) at `folder`, for tests that fill a disk (root only; the test is
    skipped elsewhere), unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)
