"""Will it fit? The memory a variant needs at a batch size and context, known before anything loads.

    peak = baseline + weights + activations + KV cache + prefix cache
      baseline     the process with the runtime imported (Python, numpy, onnxruntime, tokenizers)
      weights      what creating the ONNX Runtime session adds (initializers and their pre-packed forms)
      activations  the largest step's intermediate tensors: a = per_token x tokens + per_pair x
                   tokens x attended slots (attention scores), for a prefill step of at most
                   max_prefill_tokens new tokens over up to `context` slots, or a decode step
      KV cache     2 x layers x kv_heads x head_dim x dtype bytes a token, x batch x context, held:
                   once in shared buffers (GroupQueryAttention graphs: written in place), twice in
                   plain graphs (past in, present out, both alive during a step); a copy of the
                   cache (growth, a join that adds rows, a compaction) lets go of each source array
                   once copied (backend.rows_of), and the bound a batch is sized by counts the cache
                   twice in either form: a margin for that copy and the pages the allocator keeps

The prefix cache (runtime/prefix_cache.py) holds prompt prefixes' KV up to its budget, counted whole.

The first three are measured once at compile time, on the variant itself, in a fresh process
(`measure`, run as `python -m runtime.memory`), and stored in the manifest as the variant's `memory`;
the KV cache is computed from the interface. The engine allocates shared buffers to at most the max
context (engine.py `_capacity`), zero-filled, so the pages it never writes cost nothing.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .backends.base import host_dtype
from .errors import IncompatibleArtifact
from .manifest import Interface, Manifest, TensorSpec, Variant

GIB = 1 << 30
MIB = 1 << 20
# Prefill shapes measured at compile time: (rows, prompt tokens), smallest first (the high-water mark
# only rises), capped by the max context. They separate the per-token and the per-pair terms.
PROBE_SHAPES = ((1, 16), (1, 128), (4, 64), (1, 384), (2, 256), (1, 768))
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10**3, "kib": 1 << 10, "m": MIB, "mb": 10**6, "mib": MIB,
         "g": GIB, "gb": 10**9, "gib": GIB, "t": 1 << 40, "tb": 10**12, "tib": 1 << 40}


@dataclass(frozen=True)
class Measured:
    """A variant's memory, measured at compile time (the manifest's variants.<v>.memory)."""

    baseline_bytes: int
    weights_bytes: int
    activation_bytes_per_token: float
    activation_bytes_per_pair: float


@dataclass(frozen=True)
class Shapes:
    layers: int
    kv_heads: int
    kv_width: int  # numbers a slot of a KV head holds: the head size (an int8 cache's: its scale's 4 bytes more)
    kv_dtype_bytes: int
    shared_buffers: bool
    leading_slot: int

    @classmethod
    def of(cls, interface: Interface) -> Shapes:
        return cls(interface.layers, interface.kv_heads, interface.kv_width, host_dtype(interface.kv_dtype).itemsize,
                   interface.shared_buffers, int(interface.leading_kv_slot))

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.kv_width * self.kv_dtype_bytes


@dataclass(frozen=True)
class Plan:
    batch: int
    context: int
    prefill_tokens: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    baseline_bytes: int
    weights_bytes: int
    activation_bytes: int
    kv_bytes: int  # held while decoding: once (shared buffers) or twice (plain graphs)
    peak_bytes: int  # baseline + weights + activations + kv
    bound_bytes: int  # the same with a whole-cache copy in flight: what a batch is sized by
    measured: bool  # False: weights are the files' size and activations unknown (no measurement)
    prefix_cache_bytes: int = 0  # the prefix cache's budget, counted whole in the peak and the bound

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plan(interface: Interface, memory: dict[str, Any] | None, batch: int, context: int,
         prefill_tokens: int = 512, weights_file_bytes: int = 0, prefix_cache_bytes: int = 0) -> Plan:
    """The memory of `batch` sequences at `context` tokens each, prefill steps of `prefill_tokens`."""
    shapes = Shapes.of(interface)
    facts = Measured(**memory) if memory else Measured(0, weights_file_bytes, 0.0, 0.0)
    slots = context + shapes.leading_slot
    kv_sequence = shapes.kv_bytes_per_token * slots
    held = 1 if shapes.shared_buffers else 2
    tokens = min(prefill_tokens, context)
    activations = max(facts.activation_bytes_per_token * tokens + facts.activation_bytes_per_pair * tokens * slots,
                      (facts.activation_bytes_per_token + facts.activation_bytes_per_pair * slots) * batch)
    base = facts.baseline_bytes + facts.weights_bytes + int(activations) + prefix_cache_bytes
    return Plan(batch, context, tokens, shapes.kv_bytes_per_token, kv_sequence, facts.baseline_bytes,
                facts.weights_bytes, int(activations), held * batch * kv_sequence, base + held * batch * kv_sequence,
                base + 2 * batch * kv_sequence, memory is not None, prefix_cache_bytes)


def largest_batch(interface: Interface, memory: dict[str, Any] | None, budget: int, context: int,
                  prefill_tokens: int = 512, weights_file_bytes: int = 0, prefix_cache_bytes: int = 0) -> int:
    """The most sequences at `context` whose bound fits `budget` (0: not even one)."""
    return _largest(lambda batch: plan(interface, memory, batch, context, prefill_tokens, weights_file_bytes,
                                       prefix_cache_bytes).bound_bytes <= budget, 1 << 20)


def largest_context(interface: Interface, memory: dict[str, Any] | None, budget: int, batch: int,
                    max_context: int, prefill_tokens: int = 512, weights_file_bytes: int = 0,
                    prefix_cache_bytes: int = 0) -> int:
    """The longest context (up to max_context) at which `batch` sequences fit `budget` (0: none)."""
    return _largest(lambda context: plan(interface, memory, batch, context, prefill_tokens, weights_file_bytes,
                                         prefix_cache_bytes).bound_bytes <= budget, max_context)


def _largest(fits: Any, high: int) -> int:
    """The largest n in [0, high] with fits(n), for a `fits` that holds up to some n and not beyond."""
    low = 0
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def variant_plan(manifest: Manifest, entry: Variant, batch: int, context: int | None = None,
                 prefill_tokens: int = 512, providers: list[str] | None = None, prefix_cache_bytes: int = 0) -> Plan:
    """plan() for a variant of an artifact: its measured memory, or its files' size where it has none; its
    KV cache as the graph this host runs holds it (Kiln's CPU kernels' may be fp16)."""
    from .backends.registry import served_interface

    return plan(served_interface(entry, providers), entry.memory, batch,
                context or manifest.model.max_context, prefill_tokens, variant_file_bytes(manifest, entry),
                prefix_cache_bytes)


def variant_file_bytes(manifest: Manifest, entry: Variant) -> int:
    """The size of a variant's files (graph and external data): its weights, where none were measured."""
    files = [f for f in entry.files or (entry.model,) if f in manifest.files]
    return sum(manifest.files[f].size for f in files)


def require_fit(manifest: Manifest, entry: Variant, max_batch_size: int,
                providers: list[str] | None = None, prefill_tokens: int = 512) -> Plan | None:
    """Before loading: refuse a max_batch_size x max context that this host's free memory cannot hold
    (IncompatibleArtifact with the planner's line), instead of dying in an allocation later. None for
    variants whose memory is a GPU's (engines, CUDA providers): those are not planned here."""
    from .backends.registry import memory_on_host, served_interface

    if not memory_on_host(entry, providers):
        return None

    planned = variant_plan(manifest, entry, max_batch_size, prefill_tokens=prefill_tokens, providers=providers)
    budget = free_host_memory() + planned.baseline_bytes  # this process already holds its baseline
    if planned.bound_bytes > budget:
        most = largest_batch(served_interface(entry, providers), entry.memory, budget, planned.context,
                             prefill_tokens, planned.weights_bytes)
        raise IncompatibleArtifact(f"memory: {describe(planned, budget)}; at most {most} sequences at context "
                                   f"{planned.context} fit: lower the batch size (kiln plan shows the numbers)")
    return planned


def prefix_cache_default(kv_bytes_per_token: int, max_batch_size: int, max_context: int, free_bytes: int) -> int:
    """The prefix cache's budget where none is given (runtime/prefix_cache.py): the KV of a quarter of the
    batch's rows at the max context (a system prompt or a job's instruction is a small part of that), at
    most an eighth of the host's free memory."""
    return int(min(kv_bytes_per_token * max_context * max(1, max_batch_size // 4), free_bytes // 8))


def tokens_in_flight(planned: Plan, budget: int) -> int:
    """How many KV slots, over all running sequences, `budget` holds beside the weights and activations
    (each counted twice, for a whole-cache copy): what kiln serve admits requests by."""
    fixed = planned.baseline_bytes + planned.weights_bytes + planned.activation_bytes
    return max(0, int((budget - fixed) // (2 * planned.kv_bytes_per_token)))


# Slots a row of a chat burst takes (a long system prompt, the question and the answer): what a server
# faults in at start (warm_host_memory), per row of its batch.
WARM_SLOTS_PER_ROW = 512


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory in the process instead of handing it back to the kernel (one arena, no
    mmap'd blocks, no trimming): a server's KV buffers come and go with each burst, and pages newly
    faulted in are slow where a VM reports free pages to its host (4 to 6 s a GB on the machines Kiln
    is built on), every time they come back. The bound a batch is sized by already counts the pages the
    allocator keeps. False where the C library is not glibc: nothing changed."""
    import ctypes

    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
    return all(mallopt(option, value) == 1 for option, value in
               ((m_arena_max, 1), (m_mmap_max, 0), (m_trim_threshold, 2**31 - 1)))


def host_kv_bytes_per_token(backend: Any) -> int:
    """A token's KV bytes as this backend holds them on the host (measured on a cache of one slot); 0 for
    a backend whose KV lives on a device."""
    if not backend.limits.host_slots:
        return 0
    return sum(array.shape[1] * array.shape[3] * array.itemsize for array in backend.new_cache(1, 1))


def warm_host_memory(nbytes: int) -> None:
    """Fault nbytes in and free them: with keep_freed_memory, the first burst's KV buffers then take pages
    the process already holds."""
    block = np.empty(max(0, nbytes), np.uint8)
    block[::4096] = 1  # a write a page faults each one in
    del block


# Config keys that give a mixture of experts' expert count (whichever its family uses).
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def config_interface(config: dict[str, Any], dtype: str) -> tuple[Interface, int]:
    """An interface and the weights' bytes from a transformers config.json alone, for `kiln plan --config`:
    the KV shapes as the export would write them (shared buffers, as the fused onnxruntime graph has)."""
    def first(*keys: str, default: Any = None) -> Any:
        return next((config[k] for k in keys if config.get(k) is not None), default)

    hidden, layers = first("hidden_size", "n_embd", "d_model"), first("num_hidden_layers", "n_layer")
    heads = first("num_attention_heads", "n_head")
    if not all(isinstance(v, int) for v in (hidden, layers, heads)):
        raise IncompatibleArtifact("the config has no hidden_size, num_hidden_layers and num_attention_heads "
                                   "(or GPT-2's n_embd, n_layer, n_head): not a decoder's config.json")
    kv_heads, head_dim = first("num_key_value_heads", default=heads), first("head_dim", default=hidden // heads)
    vocab, inner = first("vocab_size", default=0), first("intermediate_size", "n_inner", default=4 * hidden)
    gated = config.get("model_type") not in ("gpt2", "gpt_neox", "gpt_bigcode", "phi", "falcon", "starcoder2")
    attention = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim
    experts = first(*EXPERT_COUNT_KEYS, default=0)
    if experts:  # every expert is resident (each token runs k of them), beside the router and a shared expert
        shared = first("shared_expert_intermediate_size", default=0)
        mlp = experts * 3 * hidden * first("moe_intermediate_size", default=inner) + hidden * experts + \
            (3 * hidden * shared + hidden if shared else 0)
    else:
        mlp = (3 if gated else 2) * hidden * inner
    per_layer = attention + mlp + 2 * hidden
    tied = config.get("tie_word_embeddings", config.get("model_type") == "gpt2")
    parameters = vocab * hidden * (1 if tied else 2) + layers * per_layer + hidden
    item = np.dtype({"fp32": "float32", "fp16": "float16", "bf16": "float16"}[dtype]).itemsize
    kv = TensorSpec("past_key_values.{layer}.key", "float32" if dtype == "fp32" else "float16", ())
    interface = Interface((TensorSpec("input_ids", "int64", ()),) * 3 + (kv,), (), layers, kv_heads, head_dim,
                          vocab, kv_sharing="shared-buffer")
    return interface, parameters * item


def report(interface: Interface, memory: dict[str, Any] | None, weights_file_bytes: int, batch: int,
           context: int, max_context: int, prefill_tokens: int, budget: int, budget_source: str,
           weights_source: str = "the files' size", prefix_cache_bytes: int | None = None) -> dict[str, Any]:
    """Everything `kiln plan` prints: the plan at batch x context, and what fits the budget. The prefix
    cache's budget is its default for this batch where None is given (0: off, or a GPU's memory)."""
    shapes = Shapes.of(interface)
    if prefix_cache_bytes is None:
        prefix_cache_bytes = prefix_cache_default(shapes.kv_bytes_per_token, batch, max_context, budget)
    planned = plan(interface, memory, batch, context, prefill_tokens, weights_file_bytes, prefix_cache_bytes)
    return {**planned.to_json(), "budget_bytes": budget, "budget_source": budget_source,
            "weights_source": "measured at compile time" if memory else weights_source,
            "fits": planned.bound_bytes <= budget, "kv_form": "shared buffers" if shapes.shared_buffers else
            "past in, present out", "kv_formula": f"2 x {shapes.layers} layers x {shapes.kv_heads} kv heads x "
                                                 f"{shapes.kv_width} x {shapes.kv_dtype_bytes} bytes",
            "largest_batch": largest_batch(interface, memory, budget, context, prefill_tokens, weights_file_bytes,
                                           prefix_cache_bytes),
            "largest_context": largest_context(interface, memory, budget, batch, max_context, prefill_tokens,
                                               weights_file_bytes, prefix_cache_bytes), "max_context": max_context}


def render(facts: dict[str, Any], title: str) -> str:
    """`kiln plan`'s table for a person."""
    rows = [
        ("weights", _size(facts["weights_bytes"]), facts["weights_source"]),
        ("baseline", _size(facts["baseline_bytes"]), "Python, numpy, onnxruntime" if facts["measured"]
         else "not measured"),
        ("KV cache a token", f"{facts['kv_bytes_per_token'] / 1024:.1f} KiB", facts["kv_formula"]),
        ("KV cache a sequence", _size(facts["kv_bytes_per_sequence"]), f"at context {facts['context']}"),
        ("activations", _size(facts["activation_bytes"]), f"prefill of {facts['prefill_tokens']} tokens"
         if facts["measured"] else "not measured: compile the model to measure them (and the baseline)"),
        ("prefix cache", _size(facts["prefix_cache_bytes"]), "its budget (kiln serve --prefix-cache-mib)"),
        (f"batch {facts['batch']} x context {facts['context']}", _size(facts["peak_bytes"]),
         f"decoding, KV held as {facts['kv_form']}"),
        ("  with a whole-cache copy", _size(facts["bound_bytes"]), "the bound a batch is sized by"),
        ("memory", _size(facts["budget_bytes"]), facts["budget_source"]),
        ("largest batch", str(facts["largest_batch"]), f"at context {facts['context']}"),
        ("largest context", str(facts["largest_context"]), f"at batch {facts['batch']} (max {facts['max_context']})"),
    ]
    width = max(len(r[0]) for r in rows)
    verdict = "fits" if facts["fits"] else "DOES NOT FIT"
    lines = [title] + [f"  {name:<{width}}  {value:>10}  {note}" for name, value, note in rows]
    return "\n".join(lines + [f"  {verdict}: batch {facts['batch']} x context {facts['context']} in "
                                f"{_size(facts['budget_bytes'])}"])


# -- the host -------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'16GiB', '512 MB', '2g', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([\d.]+(?:e\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"{text!r} is not a size; write it as 16GiB, 512MB or a number of bytes")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def free_host_memory() -> int:
    """What can be allocated without swapping: the kernel's MemAvailable, or less where this process's
    cgroup (a container's --memory, a Kubernetes limit) allows less, since /proc/meminfo shows the host."""
    available = None
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        raise IncompatibleArtifact("cannot read MemAvailable from /proc/meminfo; give --memory")
    limit, used = _cgroup_file("memory.max"), _cgroup_file("memory.current")
    return available if limit is None or used is None else min(available, max(0, limit - used))


def _cgroup_file(name: str) -> int | None:
    """A cgroup v2 memory value of this process's own cgroup; None where there is none or no limit."""
    try:
        group = Path("/proc/self/cgroup").read_text().strip().splitlines()[0].partition("::")[2]
        text = (Path("/sys/fs/cgroup") / group.lstrip("/") / name).read_text().strip()
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def free_gpu_memory(device: str) -> int:
    """Free memory of cuda:N, read through cuda-python (no torch)."""
    index = int(device.partition(":")[2] or 0)
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError:
            raise IncompatibleArtifact(f"--device {device}: cuda-python is not installed (pip install "
                                       "'kiln[gpu,tensorrt]'); give --memory instead") from None
    (error,) = cudart.cudaSetDevice(index)
    if int(error) != 0:
        raise IncompatibleArtifact(f"--device {device}: no such CUDA device ({error})")
    error, free, _ = cudart.cudaMemGetInfo()
    return int(free)


def describe(p: Plan, budget: int | None = None) -> str:
    """The planner's one-line verdict, also the runtime's refusal."""
    verdict = "" if budget is None else (f"; fits in {_size(budget)}" if p.bound_bytes <= budget
                                         else f"; does not fit in {_size(budget)}")
    return (f"batch {p.batch} x context {p.context} needs up to {_size(p.bound_bytes)} (weights "
            f"{_size(p.weights_bytes)}, KV cache {_size(2 * p.batch * p.kv_bytes_per_sequence)} with a copy in "
            f"flight, activations {_size(p.activation_bytes)}, baseline {_size(p.baseline_bytes)}){verdict}")


def _size(value: int) -> str:
    return f"{value / GIB:.2f} GiB" if value >= GIB else f"{value / MIB:.0f} MiB"


# -- measuring, at compile time -------------------------------------------------------------------

def _status(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def measure(model_path: Path, interface: Interface | dict[str, Any], max_context: int,
            threads: int | None = None) -> dict:
    """In this process, which must have imported nothing heavy yet: the baseline, what the session
    adds, then prefill steps of PROBE_SHAPES, each one's high-water mark less its KV cache, and the
    least-squares per-token and per-pair activation bytes."""
    import onnxruntime  # noqa: F401 - the libraries every runtime process loads are the baseline
    import tokenizers  # noqa: F401

    from .backends.onnxruntime import OnnxRuntimeBackend
    from .cpu_kernels import library_for

    kernels = library_for(model_path)  # loaded before the baseline
    baseline = _status("VmRSS:")
    backend = OnnxRuntimeBackend(model_path, interface, threads=threads, kernels=kernels)
    loaded = _status("VmRSS:")
    shapes = Shapes.of(Interface.of(interface))
    rows, samples = [], []
    for batch, prompt in PROBE_SHAPES:
        prompt = min(prompt, max_context - 1)
        ids = np.zeros((batch, prompt), np.int64)
        positions = np.broadcast_to(np.arange(prompt), (batch, prompt))
        cache = backend.new_cache(batch, prompt + 1)
        backend.run(ids, np.ones((batch, prompt), np.int64), positions, cache)
        kv = batch * (prompt + shapes.leading_slot + (1 if shapes.shared_buffers else 0)) * shapes.kv_bytes_per_token
        samples.append(max(0, _status("VmHWM:") - loaded - kv))
        rows.append((batch * prompt, batch * prompt * (prompt + shapes.leading_slot)))
    (per_token, per_pair), *_ = np.linalg.lstsq(np.array(rows, np.float64), np.array(samples, np.float64),
                                                rcond=None)
    return {"baseline_bytes": baseline, "weights_bytes": loaded - baseline,
            "activation_bytes_per_token": round(max(0.0, float(per_token)), 1),
            "activation_bytes_per_pair": round(max(0.0, float(per_pair)), 3)}


MEASUREMENTS = 5  # fresh processes; each number is the largest they saw (a low-mode load is 1 in 3 or so)


def measure_in_subprocess(model_path: Path, interface: Interface | dict[str, Any], max_context: int,
                          threads: int | None = None) -> dict:
    """`measure` in fresh Pythons, so the compiler's own memory (torch, the model) is not counted. What
    a session holds once loaded differs from one process to the next (SmolLM2 fp32: 695 or 882 MiB,
    run after run, with the same file and options; the difference is ONNX Runtime's pre-packed weights,
    195 MiB, which some loads keep and some do not), so each number is the largest of MEASUREMENTS."""
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parents[1]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(Interface.of(interface).to_json(), handle)
    runs = []
    try:
        for _ in range(MEASUREMENTS):
            done = subprocess.run([sys.executable, "-m", "runtime.memory", str(model_path), handle.name,
                                   str(max_context), str(threads or 0)], capture_output=True, text=True, cwd=root,
                                  env={**os.environ, "PYTHONPATH": str(root)})
            if done.returncode != 0:
                raise RuntimeError(f"measuring memory failed: {done.stderr.strip().splitlines()[-1:]}")
            runs.append(json.loads(done.stdout))
    finally:
        os.unlink(handle.name)
    return {key: max(run[key] for run in runs) for key in runs[0]}


if __name__ == "__main__":
    path, interface_file, context, threads = sys.argv[1:5]
    print(json.dumps(measure(Path(path), json.loads(Path(interface_file).read_text()), int(context),
                             int(threads) or None)))
