"""Where a model runs: `--device cpu | cuda | cuda:N | auto`, as ONNX Runtime providers.

    auto     each variant where it is built to run: a CUDA variant on the GPU where this host has one,
             a CPU variant on the CPU; without a variant named, the first built one this host runs
    cpu      the CPU provider; a CUDA variant named explicitly runs its graph on the CPU (checks, A/B)
    cuda:N   ONNX Runtime's CUDA provider on GPU N (cuda is cuda:0), the CPU's for shape arithmetic;
             only variants built for CUDA (target onnxruntime-cuda, tensorrt)

The registry (backends/registry.py) refuses a variant the device does not run, in one line, before
anything loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .errors import KilnError

DEVICE_HELP = ("cpu, cuda, cuda:N or auto: auto runs each variant where it is built to run (a CUDA variant on "
               "this host's GPU) [default: auto].")
_CUDA = re.compile(r"cuda(?::(\d{1,3}))?")


@dataclass(frozen=True)
class Device:
    kind: str  # "auto", "cpu" or "cuda"
    index: int = 0  # the GPU, for cuda

    @classmethod
    def parse(cls, text: str | None) -> Device:
        if text is None or text == "auto":
            return cls("auto")
        if text == "cpu":
            return cls("cpu")
        match = _CUDA.fullmatch(text)
        if match is None:
            raise KilnError(f"--device {text}: not cpu, cuda, cuda:N or auto")
        return cls("cuda", int(match.group(1) or 0))

    @property
    def providers(self) -> list[Any] | None:
        """ONNX Runtime's providers for this device, in order; None for auto (each variant's own)."""
        if self.kind == "cpu":
            return ["CPUExecutionProvider"]
        if self.kind == "cuda":
            return [("CUDAExecutionProvider", {"device_id": self.index}), "CPUExecutionProvider"]
        return None

    def __str__(self) -> str:
        return f"cuda:{self.index}" if self.kind == "cuda" else self.kind


def checked(context: Any, parameter: Any, text: str | None) -> str | None:
    """click's callback for a --device option: a bad value is a usage error (exit 2), named."""
    import click

    try:
        Device.parse(text)
    except KilnError as exc:
        raise click.BadParameter(str(exc).removeprefix(f"--device {text}: ")) from None
    return text


def providers_for(device: str | None, providers: list[Any] | None = None) -> list[Any] | None:
    """The providers a load asks for: the device's where one is given, else `providers` as given."""
    return Device.parse(device).providers if device is not None else providers
