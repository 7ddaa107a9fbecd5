"""What every backend is: the Backend protocol, its limits, the record of whether a host runs a variant,
and the row helpers the backends share.

A backend runs one variant's graph (or engine) one step at a time:
    run(input_ids, attention_mask, position_ids, cache) -> (logits, cache)
with the names and shapes of the manifest's interface. Besides run:
    new_cache(batch, capacity)                     an empty cache
    keep_rows(cache, rows, front=0, capacity=None) a new cache of some rows, in any order, repeated
                                                   (forks) or empty (-1); slots added or dropped in front;
                                                   `cache` is used up (its memory goes as it is copied)
    write_rows(cache, rows, source, source_rows)   rows of another cache copied in, right-aligned
    view_rows(cache, first, count)                 rows side by side as a cache in the same memory, for a
                                                   first prompt to run into; None where the backend cannot
                                                   (limits.rows_in_place says whether it ever can)
    limits                                         what the backend takes beyond the manifest's bounds
    close()                                        lets go of the session or engine and its memory; a
                                                   backend is a context manager that closes on exit
Every cache knows `length`, the slots in use: the attention mask's width at its last step.

Which backend opens a variant, and the host checks of each kind, are in registry.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ..manifest import TensorSpec

CPU_PROVIDERS = ["CPUExecutionProvider"]  # what a backend runs on where no providers are asked for


# Element types numpy lacks, held in host arrays of an unsigned integer of their width and handed to ONNX
# Runtime with their ONNX type (a bf16 CUDA variant's KV cache).
STORED_AS = {"bfloat16": (np.dtype(np.uint16), 16)}  # 16: onnx.TensorProto.BFLOAT16


def host_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds a tensor of ONNX element type `name` (numpy's name, or bfloat16)."""
    return STORED_AS[name][0] if name in STORED_AS else np.dtype(name)


def ortvalue(array: np.ndarray, dtype: str) -> Any:
    """An OrtValue over `array`'s memory, of element type `dtype` (host_dtype's name)."""
    import onnxruntime as ort

    if dtype in STORED_AS:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array, STORED_AS[dtype][1])
    return ort.OrtValue.ortvalue_from_numpy(array)


def provider_names(providers: Sequence[Any] | None) -> list[str]:
    """The names of ONNX Runtime providers given as names or (name, options) pairs; the CPU's for None."""
    return [p if isinstance(p, str) else p[0] for p in providers or CPU_PROVIDERS]


@dataclass(frozen=True)
class Limits:
    """What a backend takes, where it is less than the artifact allows (None: no bound of its own)."""

    max_batch_size: int | None = None
    max_prompt: int | None = None
    max_context: int | None = None
    # Feeding a prompt in pieces (chunked prefill), past > 0 with more than one new token: "any" batch,
    # "one-row" (ONNX Runtime's GroupQueryAttention takes it for a batch of one only), or "none" (an
    # engine's profiles are prefill or decode).
    chunked_prefill: str = "any"
    # Whether a first prompt can run straight into free rows of a running batch's cache (view_rows): rows
    # stored from slot 0 of shared buffers, so where a row sits and how wide the batch is change nothing.
    rows_in_place: bool = False
    # Whether a row's slots can be copied out to the host and a cache made from them (slots_of, cache_of):
    # what the prefix cache needs (runtime/prefix_cache.py).
    host_slots: bool = False


@runtime_checkable
class Backend(Protocol):
    """One variant's graph or engine, run step by step (the module doc has each method's contract)."""

    limits: Limits
    vocab_size: int

    def new_cache(self, batch: int, capacity: int) -> Any: ...

    def keep_rows(self, cache: Any, rows: Sequence[int], front: int = 0, capacity: int | None = None) -> Any: ...

    def write_rows(self, cache: Any, rows: Sequence[int], source: Any, source_rows: Sequence[int]) -> Any: ...

    def view_rows(self, cache: Any, first: int, count: int) -> Any | None: ...

    def slots_of(self, cache: Any, row: int, length: int, start: int, stop: int) -> list[np.ndarray]: ...

    def cache_of(self, slots: list[list[np.ndarray]], capacity: int) -> Any: ...

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            cache: Any) -> tuple[np.ndarray, Any]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Backend: ...

    def __exit__(self, *exc: object) -> None: ...


class ClosesOnExit:
    """`with backend:` closes it at the end of the block, whatever happens in it."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class HostFit:
    """Whether this host runs a variant: what the variant needs, what the host has, and why not."""

    variant: str
    target: str
    needs: str
    here: str
    fits: bool
    reason: str = ""


def expand(specs: Sequence[TensorSpec], layers: int) -> list[str]:
    """The graph's names of these tensors: a "{layer}" template once per layer."""
    out = []
    for spec in specs:
        if "{layer}" in spec.name:
            out.extend(spec.name.format(layer=i) for i in range(layers))
        else:
            out.append(spec.name)
    return out


def kv_order(names: list[str]) -> list[str]:
    """Templates list all keys then all values; the cache is ordered key, value per layer."""
    keys = [n for n in names if n.endswith(".key")]
    values = [n for n in names if n.endswith(".value")]
    return [n for pair in zip(keys, values, strict=True) for n in pair]


def rows_of(arrays: list[np.ndarray], rows: Sequence[int], lead: int, length: int, front: int,
            capacity: int | None) -> list[np.ndarray]:
    """keep_rows on host arrays of [batch, kv_heads, lead + slots, head_dim]: new arrays, each with
    `capacity` slots, or exactly lead + length + front. `arrays` is emptied as it is read: each source
    array is let go once copied, so the copy holds one array more than the larger of the two caches,
    not both caches (measured on SmolLM2, batch 8 growing to 1024 slots: 270 MiB less at the peak)."""
    rows = np.asarray(rows, np.int64)
    taken = rows >= 0
    source = slice(lead + max(0, -front), lead + length)
    target = slice(lead + max(0, front), lead + length + front)
    slots = capacity if capacity is not None else lead + length + front
    out = []
    for i in range(len(arrays)):
        array, arrays[i] = arrays[i], None
        kept = np.zeros((len(rows), array.shape[1], slots, array.shape[3]), array.dtype)
        kept[taken, :, target] = array[rows[taken], :, source]
        out.append(kept)
        del array
    return out


def write_right_aligned(arrays: list[np.ndarray], rows: Sequence[int], length: int, sources: list[np.ndarray],
                        source_rows: Sequence[int], source_length: int, lead: int) -> None:
    """write_rows on host arrays: the source rows' `source_length` slots become the last ones in use."""
    if source_length > length:
        raise ValueError(f"rows of {source_length} slots do not fit a cache of {length}; add slots in front first")
    target = slice(lead + length - source_length, lead + length)
    for array, source in zip(arrays, sources, strict=True):
        array[list(rows), :, target] = source[list(source_rows), :, lead:lead + source_length]


def with_leading_slot(attention_mask: np.ndarray) -> np.ndarray:
    """The mask over [leading slot, cache..., new tokens]: the slot is always masked out."""
    return np.concatenate([np.zeros((len(attention_mask), 1), np.int64), attention_mask], axis=1)
