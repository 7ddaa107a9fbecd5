"""Automatic prefix caching: the KV of prompt prefixes kept in blocks, so a prompt that begins as an
earlier one did prefills only the rest.

    a prompt's full blocks of BLOCK_TOKENS tokens ─> keys: a hash of the tokens up to and including
                                                      each block (vLLM's scheme: a key names its whole prefix)
    admission: the longest run of the prompt's keys held ─> those slots, copied into the request's row
               (at least one prompt token is always run: its logits pick the first token)
    the prompt prefilled ─> its blocks not yet held are copied out of its row and kept
    over the budget ─> least recently used blocks go, a chain's last blocks before its first

Why blocks copied into a row rather than shared in place: Kiln's graphs take one dense cache per batch
(engine.py's module doc), so a row's slots are contiguous memory that only it owns; copying a 300-token
prefix of SmolLM2's fp32 KV is 14 MB of memcpy (a few ms), where prefilling it is ~200 ms of compute.

Why the LRU order is reversed along a chain: a hit touches blocks 1..k in order; kept in that order the
chain's first block would be the least recently used and go first, orphaning every block after it
(vLLM frees a request's blocks in reverse for the same reason).

The blocks live in host memory as numpy arrays of the cache's own dtype, one per layer and key/value,
[kv_heads, BLOCK_TOKENS, head_dim]: the backend copies them out and in (Backend.slots_of, cache_of), so
the cache keeps whatever form the variant's KV takes (fp32, fp16).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

BLOCK_TOKENS = 16
# A request with a hit is prefilled in a group of its own (its row starts from the cached slots), and the
# requests of a burst that share a prefix wait for the first to be cached: worth it from 4 blocks on. A
# chat template's fixed header (SmolLM2's default system line, Llama 3's date header) is one or two
# blocks; waiting for that would cost every burst its batched prefill (1.27x on SmolLM2 int8) to save
# 16 or 32 tokens a prompt. A request that runs alone anyway takes any hit.
MIN_REUSE_BLOCKS = 4
Slots = list[np.ndarray]  # one array per layer's key and value: [kv_heads, tokens, head_dim]


def default_budget(backend: Any, max_batch_size: int, max_context: int, free_bytes: int) -> int:
    """memory.prefix_cache_default for this backend's KV (measured on a cache of one slot); 0 for a
    backend whose slots do not come to the host."""
    from .memory import host_kv_bytes_per_token, prefix_cache_default

    per_token = host_kv_bytes_per_token(backend)
    return prefix_cache_default(per_token, max_batch_size, max_context, free_bytes) if per_token else 0


def block_keys(prompt: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """The key of each full block of the prompt: a hash of its tokens and of the key before it."""
    keys, parent = [], b""
    tokens = np.asarray(prompt, np.int64)
    for end in range(block_tokens, len(tokens) + 1, block_tokens):
        parent = hashlib.blake2b(parent + tokens[end - block_tokens:end].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS) -> None:
        self.budget_bytes, self.block_tokens = budget_bytes, block_tokens
        self.blocks: OrderedDict[bytes, Slots] = OrderedDict()  # least recently used first
        self.bytes = 0
        # Counters of prompt tokens, vLLM's names: looked up, and found (prefill skipped).
        self.queries = 0
        self.hits = 0
        self.evicted_blocks = 0

    def usable(self, keys: list[bytes], prompt_tokens: int) -> int:
        """How many of the prompt's first blocks are held and may be reused: at least one prompt token
        is left to run."""
        most = (prompt_tokens - 1) // self.block_tokens
        count = 0
        while count < min(most, len(keys)) and keys[count] in self.blocks:
            count += 1
        return count

    def take(self, keys: list[bytes], prompt_tokens: int, use: bool = True) -> Slots | None:
        """The slots of the prompt's longest held prefix, joined along the tokens, or None (always, where
        not `use`d: a prompt prefilled with others); counts the lookup, and makes the blocks the most
        recently used (the first one last)."""
        count = self.usable(keys, prompt_tokens) if use else 0
        self.queries += prompt_tokens
        self.hits += count * self.block_tokens
        if not count:
            return None
        for key in reversed(keys[:count]):
            self.blocks.move_to_end(key)
        blocks = [self.blocks[key] for key in keys[:count]]
        return [np.concatenate([block[i] for block in blocks], axis=1) for i in range(len(blocks[0]))]

    def keep(self, keys: list[bytes], slots_of: Callable[[int, int], Slots]) -> None:
        """Hold the prompt's blocks that are not held yet; `slots_of(start, stop)` copies a range of its
        row's slots out of the cache. The blocks end as the most recently used (the first one last)."""
        missing = [i for i, key in enumerate(keys) if key not in self.blocks]
        if missing and self.budget_bytes > 0:
            start = missing[0] * self.block_tokens
            slots = slots_of(start, len(keys) * self.block_tokens)
            for i in missing:
                offset = i * self.block_tokens - start
                block = [np.ascontiguousarray(array[:, offset:offset + self.block_tokens]) for array in slots]
                self.blocks[keys[i]] = block
                self.bytes += sum(array.nbytes for array in block)
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)
        while self.bytes > self.budget_bytes and self.blocks:
            _, block = self.blocks.popitem(last=False)
            self.bytes -= sum(array.nbytes for array in block)
            self.evicted_blocks += 1

    def stats(self) -> dict[str, int]:
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_blocks": len(self.blocks), "prefix_cache_bytes": self.bytes,
                "prefix_cache_evicted_blocks": self.evicted_blocks}
