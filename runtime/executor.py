"""The step executor, the engine's second part: one forward pass's inputs, and the backend call.

    prefill  the next `size` prompt columns of a prefill group: each row's mask covers its slots so far
             (left padding masked), positions count from its first real token
    decode   one token for every row of the running batch: a free row feeds a pad that attends to its
             own slot alone (no empty softmax), its length stays 0
Both return the logits of each row's last position and leave the cache and lengths in the batch.
"""

from __future__ import annotations

import numpy as np

from .backends.base import Backend
from .scheduler import Batch, PrefillGroup


def right_aligned_mask(width: int, lengths: np.ndarray) -> np.ndarray:
    """[rows, width] attention mask whose row i is 1 in its last lengths[i] columns."""
    return (np.arange(width)[None, :] >= width - lengths[:, None]).astype(np.int64)


class StepExecutor:
    def __init__(self, backend: Backend, pad_id: int) -> None:
        self.backend, self.pad_id = backend, pad_id

    def prefill(self, prefill: PrefillGroup, size: int) -> np.ndarray:
        """Feed the group's next `size` prompt columns; the logits at the last of them, [rows, vocab]."""
        width = prefill.ids.shape[1]
        start, end = prefill.fed, prefill.fed + size
        prompt_lengths = np.array([len(r.prompt) for r in prefill.requests], np.int64)
        lengths = np.clip(end - (width - prompt_lengths), 0, prompt_lengths)
        positions = np.clip(lengths[:, None] - size + np.arange(size)[None, :], 0, None)
        logits, prefill.batch.cache = self.backend.run(prefill.ids[:, start:end], right_aligned_mask(end, lengths),
                                                       positions, prefill.batch.cache)
        prefill.fed, prefill.batch.lengths = end, lengths
        return logits[:, -1]

    def decode(self, batch: Batch) -> np.ndarray:
        """One token for every live row (each row's newest token); the logits, [rows, vocab]."""
        live = batch.live
        feed = np.where(live, batch.lengths + 1, 1)  # a free row attends to its own pad: no empty softmax
        tokens = np.array([[row.token if row is not None else self.pad_id] for row in batch.rows], np.int64)
        positions = np.where(live, batch.lengths, 0)[:, None]
        logits, batch.cache = self.backend.run(tokens, right_aligned_mask(batch.width + 1, feed), positions,
                                               batch.cache)
        batch.lengths = np.where(live, batch.lengths + 1, 0)
        return logits[:, -1]
