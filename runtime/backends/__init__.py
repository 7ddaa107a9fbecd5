"""Backends: what runs a variant's graph or engine step by step.

base.py      the Backend protocol, Limits, HostFit and the row helpers the backends share
registry.py  one row per kind of backend; opening a variant and every host check go through it
onnxruntime.py, tensorrt.py  one module per kind
"""

from .base import Backend, HostFit, Limits
from .registry import Target, kind_of, open_backend, runnable_variant, served_interface

__all__ = ["Backend", "HostFit", "Limits", "Target", "kind_of", "open_backend", "runnable_variant", "served_interface"]
