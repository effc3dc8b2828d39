"""--chat-template: read and checked in the launcher (jinja2 only: the launcher does not import transformers
before it has bound the port), handed to the tokenizer workers as text (Tokenizer.load)."""

from __future__ import annotations

from pathlib import Path

from jinja2 import Environment, TemplateError


class ChatTemplateError(ValueError):
    pass


def read_chat_template(value: str) -> str:
    """--chat-template, as vLLM reads it: a file holding the template, else the template itself. Checked at
    start-up (the launcher calls this), so a typo fails there in one line, not on the first chat request."""
    path = Path(value).expanduser()
    if path.is_file():
        template = path.read_text()
    elif not any(c in value for c in "{}\n"):
        raise ChatTemplateError(f"--chat-template {value!r}: no such file, and no Jinja template either")
    else:
        template = value
    try:
        Environment().parse(template)
    except TemplateError as exc:
        raise ChatTemplateError(f"--chat-template {value!r} is not a valid Jinja template: {exc}") from None
    return template
