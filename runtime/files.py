"""Reading the text files users hand to Kiln (recipes, prompts, gates, held-out text), with one-line errors;
and placing a big file in a second folder without a second copy where the file system allows."""

from __future__ import annotations

import os
import shutil
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


def link_or_copy(source: Path, target: Path, link: bool = True) -> None:
    """`target` as a hard link to `source` (no bytes copied), or a copy where the file system will not
    link (another device) or `link` is False."""
    try:
        if not link:
            raise OSError
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
