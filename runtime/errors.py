"""Errors the runtime raises; the CLI turns each into one line and exit code 2."""

import signal


class KilnError(Exception):
    """Base of every error Kiln reports to a user as one line."""


class ArtifactError(KilnError):
    """The artifact folder is missing, malformed or was modified after it was written."""


class IncompatibleArtifact(KilnError):
    """The artifact is fine but cannot run here (schema, runtime or execution provider)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so the process unwinds (and cleans up) as it does for Ctrl-C."""


def unwind_on_sigterm() -> None:
    def terminate(signum: int, frame: object) -> None:
        raise Terminated

    signal.signal(signal.SIGTERM, terminate)


def interrupted_exit_code(exc: KeyboardInterrupt) -> int:
    """The shell's convention, 128 + the signal: 143 for SIGTERM, 130 for Ctrl-C (SIGINT)."""
    return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
