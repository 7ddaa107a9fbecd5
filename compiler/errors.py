"""Errors of the build side. Each is turned into one clear line by the CLI (traceback with --debug)."""

from runtime.errors import KilnError


class RecipeError(KilnError):
    """The recipe file is malformed or names impossible values."""


class OutputError(KilnError):
    """The output folder cannot be used for the artifact."""


class CheckpointError(KilnError):
    """The checkpoint cannot be found or is not something Kiln can load."""


class UnsupportedArchitecture(CheckpointError):
    """The checkpoint's architecture has no entry in the family table."""


class ExportError(KilnError):
    """torch -> ONNX export failed."""


class ExportMismatch(KilnError):
    """The exported graph disagrees with eager PyTorch beyond the fp32 tolerance."""


class GateFailure(KilnError):
    """A variant missed an accuracy gate of the recipe."""


class CompareInputError(KilnError):
    """Two models cannot be compared as given (tokenizers differ, no prompts, an unknown gate)."""


class InsufficientMemory(KilnError):
    """The compile's predicted peak memory is more than this host has free."""


class InsufficientDisk(KilnError):
    """The compile's predicted disk use is more than the output folder's file system has free."""


class DiskFull(KilnError):
    """The output folder's file system filled while the compile wrote the artifact."""


class CompileProcessError(KilnError):
    """The process that runs load, export and the eager reference ended without a result."""
