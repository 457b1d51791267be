"""Chat messages into a prompt: the checkpoint's own chat template when it
has one (Jinja, as Hugging Face renders it), else a plain role-tagged format.

A template comes from ``tokenizer_config.json`` (``chat_template``: a string,
or a list of ``{"name", "template"}`` where "default" is taken) or from a
``chat_template.jinja`` file beside it. It renders in a sandbox (no attribute
access to Python internals, no I/O) with what templates expect:
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``raise_exception(msg)`` and ``strftime_now(fmt)``. The rendered text holds
the special tokens itself, so it is encoded without adding any.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Protocol

ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTokenizer(Protocol):
    """What the chat functions use of a tokenizer (``kvstrata.text.tokenizer.Tokenizer``
    has it; a tokenizer without a ``chat_template`` attribute gets the plain format)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class ChatTemplateError(ValueError):
    """A template that cannot be compiled or rendered; names its source."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    """Owns: one compiled template, its source (for errors) and the special
    token strings it may use."""

    __slots__ = ("source", "_template", "bos_token", "eos_token")

    def __init__(self, text: str, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(text)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template from {source}: {e}") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Mapping[str, object]], *, add_generation_prompt: bool = True) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"chat template from {self.source}: {e}") from None
        except (TemplateError, TypeError, ValueError) as e:
            raise ChatTemplateError(f"chat template from {self.source} failed: {type(e).__name__}: {e}") from None


def load_chat_template(directory: str | Path | None) -> ChatTemplate | None:
    """The checkpoint's chat template, or None when it has none."""
    if directory is None:
        return None
    d = Path(directory).expanduser()
    cfg_path = d / "tokenizer_config.json"
    cfg: dict[str, object] = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ChatTemplateError(f"cannot read {str(cfg_path)!r}: {e}") from None
    text, source = cfg.get("chat_template"), str(cfg_path)
    if isinstance(text, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
        text = named.get("default")
    jinja_path = d / "chat_template.jinja"
    if not isinstance(text, str) and jinja_path.is_file():
        text, source = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
    if not isinstance(text, str) or not text.strip():
        return None
    return ChatTemplate(text, source, bos_token=_token_str(cfg.get("bos_token")),
                        eos_token=_token_str(cfg.get("eos_token")))


def _token_str(token: object) -> str:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def message_dicts(messages: Sequence[object]) -> list[dict[str, object]]:
    """Messages as plain dicts with text content (parts of type "text"
    joined); raises ValueError naming the first bad one."""
    if not messages:
        raise ValueError("messages: must not be empty")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, Mapping) else getattr(m, "role", None)
        content = m.get("content") if isinstance(m, Mapping) else getattr(m, "content", None)
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role: unknown role {role!r}")
        if isinstance(content, list):
            content = "".join(
                (p.get("text", "") if isinstance(p, Mapping) else getattr(p, "text", ""))
                for p in content
                if (p.get("type") if isinstance(p, Mapping) else getattr(p, "type", None)) == "text"
            )
        out.append({"role": role, "content": content or ""})
    return out


def plain_chat(messages: Sequence[Mapping[str, object]]) -> str:
    """The fallback for checkpoints without a template: role tags, one
    message per block, the last line opening the assistant's turn."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)


def chat_prompt(tokenizer: ChatTokenizer, messages: Sequence[object]) -> str | list[int]:
    """The prompt for ``messages``: token ids of the rendered template when
    the tokenizer has one (special tokens are in the text), else the plain
    format as text (tokenized as any prompt). ValueError names what is wrong."""
    text, plain = chat_text(tokenizer, messages)
    return text if plain else tokenizer.encode(text, add_special_tokens=False)


def chat_text(tokenizer: ChatTokenizer, messages: Sequence[object]) -> tuple[str, bool]:
    """The rendered prompt for ``messages`` as text, and whether tokenizing
    it adds the tokenizer's special tokens (no when the template wrote them)."""
    msgs = message_dicts(messages)
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return plain_chat(msgs), True
    return template.render(msgs, add_generation_prompt=True), False
