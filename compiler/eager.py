"""Eager PyTorch behind the runtime's backend interface: new_cache / keep_rows / run, numpy in and out.

With it, the accuracy code decodes an eager transformers model exactly as it decodes a compiled
graph (same left padding, same prefill and decode steps), so an A/B comparison differs only in what
computes the logits. The KV cache stays as torch tensors on the model's device between steps.

Teacher-forced scoring (the held-out text, the prompts' continuations) is the exception:
`forward_row` runs a row through the model in one pass, which gives the step-by-step logits up to
fp32 rounding at a fraction of the time (every step re-enters transformers and grows the cache).
A row at a time, so the logits held are one row's, [len(row), vocab].
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .export import _make_wrapper
from .families import shapes_of
from .fp32_compute import computes_in_fp32, stop_computing_in_fp32

# transformers' own attention is the reference, never the export-only one the graph was traced with
# (compiler/attention.py): a mistake there must show up in a comparison, not be copied into both sides.
REFERENCE_ATTENTION = "eager"
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--eager-device cuda: torch sees no CUDA device on this host; use cpu or auto")
    return device


class EagerBackend:
    def __init__(self, model: Any, device: str = "cpu", dtype: str = "fp32") -> None:
        import torch

        model.set_attn_implementation(REFERENCE_ATTENTION)
        self.device = torch.device(pick_device(device))
        self.dtype = getattr(torch, DTYPES[dtype])
        self.widened = dtype == "fp32" and computes_in_fp32(model)
        self.stored_dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        if self.widened:
            model.to(device=self.device)  # its bf16 or fp16 weights stay as they are
        else:
            stop_computing_in_fp32(model)
            model.to(device=self.device, dtype=self.dtype)
        self.shapes = shapes_of(model.config)
        self.vocab_size = self.shapes.vocab_size
        self.model = model
        self.wrapper = _make_wrapper(model, self.shapes.layers, "last")

    def forward_row(self, row: list[int], last: int | None = None) -> np.ndarray:
        """The logits at every position of `row` ([len(row), vocab]), or at its last `last` positions."""
        import torch

        ids = torch.tensor([row], dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=last or 0).logits[0]
        return logits.float().cpu().numpy()

    def new_cache(self, batch: int, capacity: int) -> list[Any]:
        import torch

        shape = (batch, self.shapes.kv_heads, 0, self.shapes.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(2 * self.shapes.layers)]

    def keep_rows(self, cache: list[Any], rows: list[int]) -> list[Any]:
        return [layer[rows] for layer in cache]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
            cache: list[Any]) -> tuple[np.ndarray, list[Any]]:
        import torch

        inputs = [torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(self.device)
                  for a in (input_ids, attention_mask, position_ids)]
        with torch.inference_mode():
            logits, *present = self.wrapper(*inputs, *cache)
        return logits.float().cpu().numpy(), present
