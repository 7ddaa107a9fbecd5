"""ONNX Runtime backend: run(input_ids, attention_mask, position_ids, cache) -> (logits, cache).

The names come from the manifest's interface, never from guesses. The KV cache holds numpy arrays,
2 per layer (key, value), in the interface's [batch, kv_heads, sequence, head_dim] layout, in one of
the two forms the interface's `kv_sharing` names:
- "none": past has exactly the slots used so far; the graph returns present = past + this step.
- "shared-buffer" (GroupQueryAttention graphs): each array is preallocated to the batch's capacity
  and bound as both past and present, so ONNX Runtime writes this step's keys and values into it
  in place and the cache is never copied.

Callers see every cache right-aligned (a row's newest slot in the last column, left padding). Where
the graph reads each row's length from its mask (interface `row_lengths: mask`), the shared-buffer
backend stores each row at the front of its buffer instead, slots 0 to its length, and hands the
graph a mask in that layout: ONNX Runtime's attention then reduces over the row's own slots only,
so a row's numbers do not depend on how much padding the rest of the batch puts in front of it.
Measured on SmolLM2 cpu-int8: with left padding, the softmax's sums change in the last bit with the
pad count, int8 activation rounding grows that into different greedy tokens on 5 of 8 prompts
batched against alone; stored at the front, 8 of 8 equal.

A first prefill of prompts of different lengths (a padded prefill) runs in one step, each row's
tokens moved to the front and its pads after them, where the graph gives each row its numbers alone:
where every attention is Kiln's kernel (the manifest's `kernel_prefill: batched`; the kernel computes
a right-padded row as ONNX Runtime computes it alone, where ONNX Runtime's own GroupQueryAttention
sizes the row's blocks by the longest row and gave the tiny Llama's 33-token rows logits 1 ulp off
theirs alone) and a lone row computes as it does beside others (`min_rows` 1, below). Elsewhere, and
for a chunk after earlier ones or a batch mostly of pads, each row runs alone. Measured on SmolLM2,
32 prompts of 36 to 49 tokens generating 32 tokens each, one step against row by row: int8 1.27x
faster (time to first token 1.54x), fp32 1.14x (1.21x), the same tokens.

Lone rows: some kernels compute a row alone (one token of one sequence: a batch-1 decode step) other
than the same row beside others. ONNX Runtime's 4-bit MatMulNBits does on CPUs with AVX2 but no
AVX-512 (measured on an AMD EPYC: up to 1.4e-6 apart, while 2 and 8 rows agree), so a sequence's
tokens depended on its batch: SmolLM2 int4 gave the tokens alone for 9 of 16 prompts in a batch of 8.
A front-aligned backend finds out on load, running one token through the graph alone and beside a
copy of itself (`lone_row_differs`). Where they differ, no step runs a lone row (min_rows = 2): a
cache of one row gets a spare second row, a one-row decode step feeds the spare a dummy token (its
keys and values go to the spare's slot 0, its logits are dropped), and a one-token row of a padded
prefill runs beside a dummy in a scratch cache of its own. Then 16 of 16 prompts agree, and a
batch-1 step of SmolLM2 int4 costs 10.6 ms against 8.6 (the 4-bit kernel's one-row path is its
fastest); where they agree, nothing changes.

An interface with `leading_kv_slot` (tensorrt variants) keeps one masked slot at the front of every
cache, so past is never 0 long: TensorRT profiles cannot take zero-length dimensions reliably. The
backend adds the slot (zeros, mask 0) itself; callers never see it. Running the tensorrt graph here
with the slot checks the exact form the engine is driven in.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..artifact import version_tuple
from ..errors import IncompatibleArtifact
from ..manifest import Interface, Manifest, Variant
from .base import (
    CPU_PROVIDERS,
    ClosesOnExit,
    HostFit,
    Limits,
    expand,
    host_dtype,
    kv_order,
    ortvalue,
    provider_names,
    rows_of,
    with_leading_slot,
    write_right_aligned,
)

# onnxruntime release that first runs each ONNX opset (its release notes). Graphs with contrib ops
# (fused GroupQueryAttention, RMSNorm, rotary; MatMulNBits) need the oldest release they were run on:
# onnxruntime-gpu 1.31.1, the gpu extra, ran the fused fp32, int8 and int4 graphs of 1.32 builds.
MIN_ONNXRUNTIME_FOR_OPSET = {17: (1, 13), 18: (1, 14), 19: (1, 16), 20: (1, 17), 21: (1, 18)}
MIN_ONNXRUNTIME_FOR_CONTRIB_OPS = (1, 31)


def open_variant(folder: Path, entry: Variant, providers: list[str] | None = None,
                 threads: int | None = None, verified: bool = True) -> OnnxRuntimeBackend:
    """A variant's graph for Kiln's CPU kernels where this host runs them (runtime/cpu_kernels.py), else its
    ONNX graph; refused in one line where the variant runs on those kernels alone and they do not run here."""
    library = kernel_library(entry, providers)
    if library is not None:
        return OnnxRuntimeBackend(folder / entry.kernel_model, kernel_interface(entry), providers, threads, library)
    refused = refusal(entry, providers)
    if refused:
        raise IncompatibleArtifact(refused)
    return OnnxRuntimeBackend(folder / entry.model, entry.interface, providers, threads)


def host_fit(name: str, entry: Variant, manifest: Manifest) -> HostFit:
    """Whether this host's onnxruntime runs the variant's graph: new enough for its opset and contrib ops."""
    target = entry.target
    opset = manifest.document.get("recipe", {}).get("export", {}).get("opset", 18)
    needed = MIN_ONNXRUNTIME_FOR_OPSET.get(opset, (1, 18))
    contrib = any(entry.document.get("fusions", {}).values()) or (entry.quantize or {}).get("mode") in (
        "int8-dynamic", "int4")
    if contrib:
        needed = max(needed, MIN_ONNXRUNTIME_FOR_CONTRIB_OPS)
    needs = f"onnxruntime >= {'.'.join(map(str, needed))}" + (" (contrib ops)" if contrib else f" (opset {opset})")
    try:
        import onnxruntime
    except ImportError:
        return HostFit(name, target, needs, "onnxruntime not installed", False, "install kiln[cpu] or kiln[gpu]")
    here = version_tuple(onnxruntime.__version__)
    providers = ", ".join(p.removesuffix("ExecutionProvider") for p in onnxruntime.get_available_providers())
    fits = here[:2] >= needed
    return HostFit(name, target, needs, f"onnxruntime {onnxruntime.__version__} ({providers})", fits,
                   "" if fits else "upgrade onnxruntime")


def refusal(entry: Variant, providers: list[str] | None = None) -> str | None:
    """Why this host may not run the variant, known before anything loads; else None."""
    return kernels_required(entry, providers)


def kernels_required(entry: Variant, providers: list[str] | None = None) -> str | None:
    """Why this host may not run the variant, where it is for Kiln's CPU kernels alone (the recipe's
    `cpu_kernels: required`: its gates held their graph, not model.onnx's) and they do not run here; else
    None."""
    if entry.cpu_kernels != "required" or kernel_library(entry, providers) is not None:
        return None
    from .. import cpu_kernels

    why = (cpu_kernels.library()[1] if provider_names(providers) == CPU_PROVIDERS
           else f"the providers asked for ({', '.join(provider_names(providers))}) are not the CPU's")
    missed = (f"; its model.onnx missed them: {', '.join(entry.model_failed_gates)}"
              if entry.model_failed_gates else "")
    return (f"variant {entry.name!r} runs only on Kiln's CPU kernels (cpu_kernels: required, its gates "
            f"held their graph{missed}), which do not run here: {why}; pick another variant, or run it where they do "
            "(the CPU provider, an x86-64 CPU with AVX-512 VNNI)")


def kernel_library(entry: Variant, providers: list[str] | None = None) -> Path | None:
    """Kiln's CPU kernel library where this host runs the variant's graph for it, else None."""
    if entry.kernel_model is None or provider_names(providers) != CPU_PROVIDERS:
        return None
    from .. import cpu_kernels

    return cpu_kernels.library()[0]


def served_interface(entry: Variant, providers: list[str] | None = None) -> Interface:
    """The interface of the graph open_variant runs for the entry on this host (the memory plan's too)."""
    return kernel_interface(entry) if kernel_library(entry, providers) is not None else entry.interface


def kernel_interface(entry: Variant) -> Interface:
    """The interface of a variant's graph for Kiln's CPU kernels: the variant's, with how it prefills
    (`kernel_prefill`) and its KV cache's type (`kernel_kv_cache`, fp32 where absent)."""
    interface = dataclasses.replace(entry.interface, prefill=entry.kernel_prefill or "rows",
                                    activations=entry.kernel_activations)
    return interface.with_kv_dtype(entry.kernel_kv_cache) if entry.kernel_kv_cache else interface


class KvCache(list):
    """A batch's KV cache: key and value per layer, each [batch, kv_heads, slots, head_dim], and `length`,
    the slots in use. Plain form: the arrays hold exactly those slots (after the leading slot, where the
    interface has one). Shared-buffer form: each array holds `capacity` slots, the first `length` in
    use, and carries the IO binding that points ONNX Runtime at them (made on first use)."""

    def __init__(self, arrays: list[np.ndarray], length: int = 0, shared: bool = False,
                 batch: int | None = None) -> None:
        super().__init__(arrays)
        self.length, self.shared = length, shared
        # Read once: keep_rows empties a cache as it copies it, while other threads may ask (stats).
        # The arrays may hold a spare row beyond the batch (`min_rows` in the module doc).
        self.batch = arrays[0].shape[0] if batch is None else batch
        self.capacity: int | None = arrays[0].shape[2] if shared else None
        self.binding: Any = None
        self.values: list | None = None
        self.seq: int | None = None  # the sequence length the logits output is bound for
        self.logits: np.ndarray | None = None  # the array it is bound to


class OnnxRuntimeBackend(ClosesOnExit):
    def __init__(self, model_path: Path, interface: Interface | Mapping[str, Any], providers: list[str] | None = None,
                 threads: int | None = None, kernels: Path | None = None, profile: Path | None = None) -> None:
        """`kernels`: Kiln's CPU kernel library, for a graph with its ops (runtime/cpu_kernels.py). `profile`:
        where ONNX Runtime's profiler writes (the file name's start), for which provider ran each node."""
        import onnxruntime as ort

        providers = providers or CPU_PROVIDERS
        require_providers(providers)
        options = ort.SessionOptions()
        # Decoding is a chain of small dependent ops: all cores on each op, no inter-op pool.
        options.intra_op_num_threads = threads or os.cpu_count() or 1
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3  # warnings about pruned initializers are noise to a user
        if kernels is not None:
            options.register_custom_ops_library(str(kernels))
        if profile is not None:
            options.enable_profiling, options.profile_file_prefix = True, str(profile)
        self.kernels = kernels
        self.session = ort.InferenceSession(str(model_path), options, providers=providers)
        interface = Interface.of(interface)
        self.past_names = kv_order(expand(interface.past, interface.layers))
        self.output_names = ["logits", *kv_order(expand(interface.present, interface.layers))]
        self.kv_heads, self.head_dim = interface.kv_heads, interface.head_dim
        self.kv_width = interface.kv_width  # the head size, or an int8 cache's codes and scale a slot
        self.vocab_size = interface.vocab_size
        self.logits_dtype = np.dtype(interface.logits_dtype)
        self.kv_type = interface.kv_dtype  # ONNX's name: bfloat16 is held in uint16 arrays (base.STORED_AS)
        self.kv_dtype = host_dtype(interface.kv_dtype)
        self.shared = interface.shared_buffers
        self.front_aligned = self.shared and interface.row_lengths == "mask"
        self.logits_last = interface.logits == "last"
        self.lead = int(interface.leading_kv_slot)
        self.min_rows = 1
        if self.front_aligned and self.lone_row_differs():
            self.min_rows = 2
        self.rows_alike_in_prompts = interface.prefill == "batched"  # every attention Kiln's
        self.limits = Limits(chunked_prefill="one-row" if self.shared else "any", rows_in_place=self.front_aligned,
                             host_slots=True)

    @property
    def batched_prefill(self) -> bool:
        """Whether prompts of different lengths prefill in one step: where the graph gives each row of a
        right-padded first prompt its numbers alone (interface `prefill: batched`) and so does a lone row."""
        return self.front_aligned and self.rows_alike_in_prompts and self.min_rows == 1

    def new_cache(self, batch: int, capacity: int) -> KvCache:
        """An empty cache for `batch` rows; a shared-buffer cache holds up to `capacity` slots."""
        slots = capacity if self.shared else self.lead
        return KvCache(self._zeros(len(self._with_spare(range(batch))), slots), 0, self.shared, batch)

    def keep_rows(self, cache: KvCache, rows: Sequence[int], front: int = 0, capacity: int | None = None) -> KvCache:
        """A cache of these rows of `cache`, in this order: a row may repeat (sequences forked from one
        prompt) and -1 is an empty row. front > 0 puts that many empty slots before the first one,
        front < 0 drops the first -front slots (pads in every row). Shared buffers get `capacity` slots
        (default: as many as before)."""
        cache = self._cache(cache)
        capacity = capacity or cache.capacity
        if self.front_aligned:  # rows start at slot 0: pad columns in front exist only in callers' view
            length = cache.length + front
            if capacity == cache.capacity and list(rows) == list(range(cache.batch)):
                cache.length = length
                return cache
            kept = rows_of(_released(cache), self._with_spare(rows), 0, min(length, cache.length), 0, capacity)
            return KvCache(kept, length, True, len(rows))
        if self.shared and front < 0 and capacity == cache.capacity and list(rows) == list(range(cache.batch)):
            for array in cache:  # the same rows, moved to the front of the same buffers: no new memory
                for row in array:
                    row[:, :cache.length + front] = row[:, -front:cache.length]
            cache.length += front
            return cache
        kept = rows_of(_released(cache), rows, self.lead, cache.length, front, capacity if self.shared else None)
        return KvCache(kept, cache.length + front, self.shared)

    def view_rows(self, cache: KvCache, first: int, count: int) -> KvCache | None:
        """Rows first to first + count - 1 of a front-aligned cache as an empty cache of their own, in the
        same memory: a first prompt run on it is written into those rows (limits.rows_in_place). None
        for fewer rows than a step takes (`min_rows`): they need a spare row beside them."""
        if not self.front_aligned or count < self.min_rows:
            return None
        cache = self._cache(cache)
        return KvCache([array[first:first + count] for array in cache], 0, True, count)

    def slots_of(self, cache: KvCache, row: int, length: int, start: int, stop: int) -> list[np.ndarray]:
        """Copies of a row's slots start..stop-1, counted from its first (the row holds `length`), one
        array per past tensor, [kv_heads, stop - start, head_dim]."""
        cache = self._cache(cache)
        first = 0 if self.front_aligned else self.lead + cache.length - length
        return [array[row, :, first + start:first + stop].copy() for array in cache]

    def cache_of(self, slots: list[list[np.ndarray]], capacity: int) -> KvCache:
        """A cache whose rows hold these slots (a list per row, as many slots in each), as if their
        tokens had been prefilled there; shared buffers get `capacity` slots."""
        count = slots[0][0].shape[1]
        if self.shared:
            cache = self.new_cache(len(slots), max(capacity, count))
            first = 0 if self.front_aligned else self.lead
        else:
            cache = KvCache(self._zeros(len(slots), self.lead + count), 0, False)
            first = self.lead
        for row, row_slots in enumerate(slots):
            for array, part in zip(cache, row_slots, strict=True):
                array[row, :, first:first + count] = part
        cache.length = count
        return cache

    def write_rows(self, cache: KvCache, rows: Sequence[int], source: KvCache, source_rows: Sequence[int]) -> KvCache:
        """Copy `source_rows` of `source` into `rows` of `cache`, in place, newest slots aligned."""
        if self.front_aligned:
            if source.length > cache.capacity:
                raise ValueError(f"rows of {source.length} slots do not fit buffers of {cache.capacity}")
            for array, rows_from in zip(cache, source, strict=True):
                array[list(rows), :, :source.length] = rows_from[list(source_rows), :, :source.length]
            return cache
        write_right_aligned(list(cache), rows, cache.length, list(source), source_rows, source.length, self.lead)
        return cache

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            cache: list[np.ndarray]) -> tuple[np.ndarray, KvCache]:
        cache = self._cache(cache)
        if self.front_aligned:
            return self._run_front_aligned(input_ids, attention_mask, position_ids, cache)
        if self.shared:
            return self._run_in_place(input_ids, attention_mask, position_ids, cache)
        if self.lead:
            attention_mask = with_leading_slot(attention_mask)
        feed = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        feed.update(zip(self.past_names, cache, strict=True))
        logits, *present = self.session.run(self.output_names, feed)
        return logits, KvCache(present, attention_mask.shape[1] - self.lead)

    def close(self) -> None:
        self.session = None

    def lone_row_differs(self) -> bool:
        """Whether one token run alone gets other logits than the same token beside a copy of itself."""
        def run(rows: int) -> np.ndarray:
            token, position = np.ones((rows, 1), np.int64), np.zeros((rows, 1), np.int64)
            return self._run_in_place(token, token, position, KvCache(self._zeros(rows, 1), 0, True))[0]

        return not np.array_equal(run(1)[0], run(2)[0])

    def _zeros(self, rows: int, slots: int) -> list[np.ndarray]:
        return [np.zeros((rows, self.kv_heads, slots, self.kv_width), self.kv_dtype) for _ in self.past_names]

    def _with_spare(self, rows: Sequence[int]) -> list[int]:
        """`rows`, and an empty one after a lone row where the graph takes no lone rows (`min_rows`)."""
        rows = list(rows)
        return rows + [-1] * (self.min_rows - len(rows)) if 0 < len(rows) < self.min_rows else rows

    def _cache(self, cache: list[np.ndarray]) -> KvCache:
        """Arrays from elsewhere (a caller's own list) as a cache: their slots are all in use."""
        if isinstance(cache, KvCache):
            return cache
        return KvCache(list(cache), 0 if self.shared else cache[0].shape[2] - self.lead, self.shared)

    def _run_front_aligned(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                           cache: KvCache) -> tuple[np.ndarray, KvCache]:
        """A step on rows stored from slot 0: the callers' right-aligned mask becomes each row's length."""
        seq = input_ids.shape[1]
        lengths, new = row_lengths(attention_mask, seq, cache.capacity)
        rows, spare = len(input_ids), cache[0].shape[0] - len(input_ids)
        if rows * seq < self.min_rows and spare:  # a lone decode step: a dummy token in the spare row
            logits, cache = self._run_in_place(*self._beside_dummy(input_ids, lengths, position_ids, spare), cache)
            logits = logits[:rows]
        elif seq == 1 or (np.all(new == seq) and np.all(lengths == seq)):
            logits, _ = self._run_in_place(input_ids, front_mask(lengths), position_ids, _first_rows(cache, rows))
        elif self.batched_prefill and np.all(lengths == new) and new.min() > 0 and 2 * new.sum() >= rows * new.max():
            logits = self._run_first_prompts(input_ids, new, position_ids, _first_rows(cache, rows))
        else:  # a chunk after earlier ones, or a padded prefill mostly of pads: each row alone, without its pads
            logits = np.zeros((len(input_ids), 1 if self.logits_last else seq, self.vocab_size), np.float32)
            for row in np.flatnonzero(new):
                count, view = int(new[row]), KvCache([array[row:row + 1] for array in cache], 0, True)
                if count < self.min_rows:
                    out = self._run_lone_row(input_ids[row, -1], position_ids[row, -1], int(lengths[row]), view)
                else:
                    out, _ = self._run_in_place(input_ids[row:row + 1, seq - count:],
                                                np.ones((1, int(lengths[row])), np.int64),
                                                position_ids[row:row + 1, seq - count:], view)
                logits[row, logits.shape[1] - out.shape[1]:] = out[0]
        cache.length = attention_mask.shape[1]
        return logits, cache

    def _run_first_prompts(self, input_ids: np.ndarray, new: np.ndarray, position_ids: np.ndarray,
                           cache: KvCache) -> np.ndarray:
        """Rows' first prompts of different lengths in one step, each moved to the front of its row (pads
        after it, where the row's mask ends): what each row computes is what it computes alone."""
        rows, seq = input_ids.shape
        # Column j of row i is the caller's column (j + pads_i) mod seq: its tokens first, then its pads.
        columns = (np.arange(int(new.max()))[None, :] + (seq - new)[:, None]) % seq
        ids = np.take_along_axis(input_ids, columns, 1)
        positions = np.take_along_axis(np.asarray(position_ids), columns, 1)
        out, _ = self._run_in_place(ids, front_mask(new), positions, cache)
        if self.logits_last:  # the graph takes each row's last token by its mask
            return out
        logits = np.zeros((rows, seq, self.vocab_size), out.dtype)
        for row, count in enumerate(new):
            logits[row, seq - count:] = out[row, :count]
        return logits

    @staticmethod
    def _beside_dummy(input_ids: np.ndarray, lengths: np.ndarray, position_ids: np.ndarray, dummies: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A one-token step's inputs with `dummies` rows after the real ones: token 0 at position 0, each
        row's mask one slot long, so the dummy's keys and values go to its own row's slot 0."""
        lengths = np.concatenate([lengths, np.ones(dummies, lengths.dtype)])
        pad = np.zeros((dummies, 1), np.int64)
        return np.concatenate([input_ids, pad]), front_mask(lengths), np.concatenate([position_ids, pad])

    def _run_lone_row(self, token: int, position: int, length: int, row: KvCache) -> np.ndarray:
        """One new token for a row whose cache is the 1-row view `row` (slots 0 to length - 1 in use after
        this step), run beside a dummy in a scratch cache: a copy of the row's past slots, then the new
        slot written back."""
        scratch = self.new_cache(self.min_rows, length)
        for array, source in zip(scratch, row, strict=True):
            array[0, :, :length - 1] = source[0, :, :length - 1]
        logits, _ = self._run_in_place(*self._beside_dummy(np.array([[token]]), np.array([length]),
                                                           np.array([[position]]), self.min_rows - 1), scratch)
        for array, source in zip(row, scratch, strict=True):
            array[0, :, length - 1] = source[0, :, length - 1]
        return logits[:1]

    def _run_in_place(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                      cache: KvCache) -> tuple[np.ndarray, KvCache]:
        if attention_mask.shape[1] > cache.capacity:
            raise ValueError(f"{attention_mask.shape[1]} slots do not fit the KV buffers' {cache.capacity}")
        if cache.values is None:  # an OrtValue over the array's memory: the same bytes are past and present
            cache.values = [ortvalue(array, self.kv_type) for array in cache]
        logits = run_in_place(self.session, cache, cache.values, self.past_names, self.output_names[1:],
                              (input_ids, attention_mask, position_ids), self.logits_last, self.vocab_size,
                              self.logits_dtype)
        return logits, cache


def require_providers(providers: Sequence[Any]) -> None:
    """Refuse, in one line, providers this onnxruntime build does not have (naming those it has)."""
    import onnxruntime as ort

    missing = [p for p in provider_names(providers) if p not in ort.get_available_providers()]
    if missing:
        raise IncompatibleArtifact(f"execution provider {missing[0]} is not available in this onnxruntime build; "
                                   f"available: {', '.join(ort.get_available_providers())}")


def row_lengths(attention_mask: np.ndarray, seq: int, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's length and its new tokens at a step on rows stored from slot 0, from the callers'
    right-aligned mask; refused where the buffers are short or a row in use feeds no token."""
    if attention_mask.shape[1] > capacity:
        raise ValueError(f"{attention_mask.shape[1]} slots do not fit the KV buffers' {capacity}")
    lengths = attention_mask.sum(1)
    new = attention_mask[:, -seq:].sum(1)
    if np.any((new == 0) & (lengths > 0)):
        raise ValueError("a row with slots in use must feed its next token: its newest column is masked")
    return lengths, new


def run_in_place(session: Any, cache: Any, values: Sequence[Any], past_names: Sequence[str],
                 present_names: Sequence[str], inputs: tuple[np.ndarray, np.ndarray, np.ndarray], logits_last: bool,
                 vocab_size: int, logits_dtype: np.dtype) -> np.ndarray:
    """One step over KV buffers (OrtValues `values`, wherever they live) bound as past and present alike,
    once per cache: the graph updates them in place. The logits go into an array of ours, bound once per
    shape (prefill -> decode with `logits: all` changes it): reading ONNX Runtime's own output back
    (get_outputs) wraps every bound output, the KV buffers too, on each step. `cache` keeps the binding."""
    import onnxruntime as ort

    input_ids, attention_mask, position_ids = inputs
    if cache.binding is None:
        cache.binding = session.io_binding()
        for name, value in zip(past_names, values, strict=True):
            cache.binding.bind_ortvalue_input(name, value)
    if cache.seq != input_ids.shape[1]:
        cache.binding.clear_binding_outputs()
        rows = 1 if logits_last else input_ids.shape[1]
        cache.logits = np.empty((len(input_ids), rows, vocab_size), logits_dtype)
        cache.binding.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(cache.logits))
        for name, value in zip(present_names, values, strict=True):
            cache.binding.bind_ortvalue_output(name, value)
        cache.seq = input_ids.shape[1]
    for name, array in (("input_ids", input_ids), ("attention_mask", attention_mask), ("position_ids", position_ids)):
        cache.binding.bind_cpu_input(name, np.ascontiguousarray(array, np.int64))
    session.run_with_iobinding(cache.binding)
    cache.length = attention_mask.shape[1]
    return cache.logits.copy()  # a copy: the next step writes the same buffer


def _first_rows(cache: KvCache, rows: int) -> KvCache:
    """The cache's first `rows` rows, without the spare row behind them where it has one."""
    return KvCache([array[:rows] for array in cache], 0, True) if cache[0].shape[0] > rows else cache


def _released(cache: KvCache) -> list[np.ndarray]:
    """The cache's arrays, for keep_rows to copy and let go of one by one: the cache itself (and ONNX
    Runtime's binding, which holds views of them) keeps none."""
    arrays = list(cache)
    cache.clear()
    cache.binding = cache.values = None
    return arrays


def front_mask(lengths: np.ndarray) -> np.ndarray:
    """The mask of rows stored from slot 0: row i's first lengths[i] slots (at least one column)."""
    return (np.arange(max(int(lengths.max()), 1))[None, :] < lengths[:, None]).astype(np.int64)


