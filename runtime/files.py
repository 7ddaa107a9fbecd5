"""Reading the text files users hand to Kiln (recipes, prompts, gates, held-out text), with one-line errors."""

from __future__ import annotations

from pathlib import Path

from .errors import KilnError


def read_utf8(path: Path, where: str, form: str, error: type[KilnError] = KilnError) -> str:
    """The file's text, or `error` starting with `where` (the file and its role: "recipe r.yaml"):
    missing, unreadable, or not UTF-8 text of the expected form ("YAML", "JSON lines") at all."""
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise error(f"{where}: {exc.strerror or exc}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not a UTF-8 {form} file (byte 0x{raw[exc.start]:02x} at offset "
                    f"{exc.start})") from None
