"""A bf16 or fp16 model that computes in fp32, holding its weights as the checkpoint stores them.

Each module that owns weights widens them to fp32 copies when it is called and drops the copies when
it returns. Every bf16 and fp16 value is an fp32 value, so this is the fp32 model's arithmetic on the
same values (tested against the model loaded in fp32 for every family: within one fp32 rounding, where
a GEMM kernel blocks a product differently for a fresh copy), in half the memory: the compile's eager
stages hold 0.26 GiB of weights for a 135M bf16 checkpoint, not 0.51, and the largest copy alive at
once is one module's (the embedding, shared with the output head).
"""

from __future__ import annotations

from typing import Any

_HANDLES = "_kiln_fp32_compute"  # the model's attribute that holds the hooks' handles
_STORED = "_kiln_stored_weights"  # a module's own weights as stored, while it runs on fp32 copies
_DEPTH = "_kiln_call_depth"  # how many calls of the module are under way (a module may call itself)


def compute_in_fp32(model: Any) -> None:
    handles = []
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None:
            handles.append(module.register_forward_pre_hook(_widen))
            handles.append(module.register_forward_hook(_narrow, always_call=True))
    setattr(model, _HANDLES, handles)


def computes_in_fp32(model: Any) -> bool:
    return bool(getattr(model, _HANDLES, None))


def stop_computing_in_fp32(model: Any) -> None:
    """The model as it is stored again: its modules run on their weights as they are."""
    for handle in getattr(model, _HANDLES, ()):
        handle.remove()
    setattr(model, _HANDLES, [])


def _widen(module: Any, args: Any) -> None:
    depth = getattr(module, _DEPTH, 0)
    setattr(module, _DEPTH, depth + 1)
    if depth:  # a module called within its own call: its weights are wide already
        return
    stored = {name: weight.data for name, weight in module.named_parameters(recurse=False)}
    setattr(module, _STORED, stored)  # first, so that _narrow puts back whatever was widened
    for weight in module.parameters(recurse=False):
        weight.data = weight.data.float()


def _narrow(module: Any, args: Any, output: Any) -> None:
    depth = getattr(module, _DEPTH, 1) - 1
    setattr(module, _DEPTH, depth)
    stored = getattr(module, _STORED, None)
    if depth or stored is None:
        return
    for name, weight in module.named_parameters(recurse=False):
        weight.data = stored[name]
    delattr(module, _STORED)
