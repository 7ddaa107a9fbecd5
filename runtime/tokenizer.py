"""The artifact's tokenizer: the `tokenizers` library on tokenizer.json, plus the model's chat template
rendered with jinja2 the way transformers renders it (sandboxed, trim_blocks, lstrip_blocks)."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer as _Fast

        self.folder = folder
        self._fast = _Fast.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.is_file() else {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._fast.encode(text, add_special_tokens=add_special_tokens).ids

    def json(self) -> str:
        """tokenizer.json as the library holds it (llguidance builds its own view of the vocabulary from it)."""
        return self._fast.to_str()

    def decode(self, ids: list[int]) -> str:
        return self._fast.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token as text, special tokens included (a piece of a UTF-8 character shows as U+FFFD)."""
        return self._fast.decode([token], skip_special_tokens=False)

    def token_bytes(self, token: int) -> list[int]:
        """The bytes one token stands for: exact for byte-level BPE, whose pieces of characters have no
        text of their own; the UTF-8 of its text otherwise."""
        piece = self._fast.id_to_token(token)
        if self._byte_level and piece is not None and all(c in _BYTE_OF_CHAR for c in piece):
            return [_BYTE_OF_CHAR[c] for c in piece]
        return list(self.token_text(token).encode())

    @cached_property
    def _byte_level(self) -> bool:
        decoder = json.loads(self._fast.to_str()).get("decoder") or {}
        kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
        return "ByteLevel" in kinds

    @property
    def vocab(self) -> dict[str, int]:
        return self._fast.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._fast.get_vocab_size(with_added_tokens=True)

    def special_token(self, key: str) -> str | None:
        value = self.config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    @cached_property
    def chat_template(self) -> str | None:
        path = self.folder / "chat_template.jinja"
        if path.is_file():
            return path.read_text()
        template = self.config.get("chat_template")
        return template if isinstance(template, str) else None

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Raises ValueError for what is wrong with this request (no template, a template's own check)."""
        from jinja2 import TemplateError

        if self.chat_template is None:
            raise ValueError("the model has no chat template, so chat prompts cannot be used")
        try:
            text = _compiled(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{key: self.special_token(key) for key in SPECIAL_KEYS},
            )
        except TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from None
        # The template writes the special tokens itself, as transformers' apply_chat_template assumes.
        return self.encode(text, add_special_tokens=False)


class IncrementalDecoder:
    """The text a growing sequence of generated tokens adds, token by token, at a cost that does not
    grow with the length generated: each token decodes a window of the last few tokens only.

    The window starts on the prompt's last tokens, so a first token whose text depends on what is
    before it (SentencePiece's leading space) decodes as it does in the whole text. Text is held back
    while the window ends in part of a UTF-8 character (U+FFFD), until a later token completes it
    (at most MAX_HELD tokens, so a model that emits broken bytes cannot make the window grow).
    The scheme is the one TGI and vLLM use (prefix and read offsets).
    """

    PROMPT_CONTEXT = 5
    MAX_HELD = 4  # a UTF-8 character has at most 4 bytes: a longer broken run is let out as U+FFFD

    def __init__(self, tokenizer: Tokenizer, prompt: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt[-self.PROMPT_CONTEXT:])
        self.prefix, self.read = 0, len(self.ids)
        self.prefix_text = tokenizer.decode(self.ids)

    def add(self, token: int) -> str:
        """The new text that `token` completes (often empty)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if text == self.prefix_text:  # the token adds nothing (a special token skipped): move past it
            self._slide()
            return ""
        if len(text) <= len(self.prefix_text):
            return ""
        if text.endswith("\ufffd") and len(self.ids) - self.read < self.MAX_HELD:
            return ""
        delta = text[len(self.prefix_text):]
        self._slide()
        return delta

    def _slide(self) -> None:
        """The tokens read so far become the new window's context."""
        self.prefix, self.read = self.read, len(self.ids)
        self.prefix_text = self.tokenizer.decode(self.ids[self.prefix:self.read])

    def flush(self) -> str:
        """Text still held back at the end of the sequence (an incomplete character shows as U+FFFD)."""
        text = self.tokenizer.decode(self.ids[self.prefix:])
        delta = text[len(self.prefix_text):] if len(text) > len(self.prefix_text) else ""
        self.read, self.prefix_text = len(self.ids), text
        return delta


def _byte_table() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: byte-level BPE writes each byte as one printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF_CHAR = _byte_table()


def _raise(message: str) -> None:
    raise ValueError(message)


_TEMPLATES: dict[str, Any] = {}


def _compiled(source: str) -> Any:
    if source not in _TEMPLATES:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
