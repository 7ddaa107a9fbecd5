"""Errors the runtime raises; the CLI turns each into one line and exit code 2."""


class KilnError(Exception):
    """Base of every error Kiln reports to a user as one line."""


class ArtifactError(KilnError):
    """The artifact folder is missing, malformed or was modified after it was written."""


class IncompatibleArtifact(KilnError):
    """The artifact is fine but cannot run here (schema, runtime or execution provider)."""
