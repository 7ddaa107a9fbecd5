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

    def decode(self, ids: list[int]) -> str:
        return self._fast.decode(ids, skip_special_tokens=True)

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
