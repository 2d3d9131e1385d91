"""Which chat template renders a chat request: the model's own, the server's ``--chat-template`` (vLLM's
flag: a file, or the Jinja text itself), or the request's ``chat_template`` (vLLM's field, served only
under ``--trust-request-chat-template``); loading and checking them.

A small model's own template can teach it a quirk (a tools preamble whose example call it imitates), and
a model without one cannot chat at all: the flag serves a better one, and ``GET /props`` shows what is
served (``server.serving_props``). A request's template is the client's Jinja, run in the tokenizer
thread every request shares: transformers renders it sandboxed, but nothing bounds its work, so it is
refused unless the server trusts its clients, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from servelm.server.errors import bad_request

# vLLM's rule: a value that names no readable file and holds one of these is the template itself.
_JINJA_CHARS = "{}\n"
# What --chat-template must render at start-up: a conversation every chat template serves.
_PROBE = [{"role": "user", "content": "Hello"}]


@dataclass(frozen=True)
class ChatTemplate:
    """The template one request is rendered with: ``text`` (None: the tokenizer's own) and whether the
    request sent it (its errors then name the request's ``chat_template``)."""

    text: str | None = None
    from_request: bool = False


def load_chat_template(value: str) -> str:
    """``--chat-template``'s value as a template: the file it names, else the value itself when it holds
    ``{``, ``}`` or a newline. ValueError (its message for the operator) for anything else."""
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"{value!r} is not a UTF-8 text file ({e.reason} at byte {e.start})") from None
    except (OSError, ValueError) as e:  # ValueError: a NUL in the value
        if any(c in value for c in _JINJA_CHARS):
            return value
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"{value!r} looks like a file path, but it cannot be read ({reason})") from None


def check_chat_template(text: str) -> None:
    """ValueError unless ``text`` compiles and renders a one-message conversation (checked at start-up,
    before the model loads: a template that cannot serve a chat should not wait for its first request)."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        render_jinja_template(conversations=[_PROBE], chat_template=text, add_generation_prompt=True)
    except TemplateSyntaxError as e:
        raise ValueError(f"the template {_syntax(e)}") from None
    except Exception as e:
        raise ValueError(f"the template cannot render a one-message conversation: {e}") from None


def pick_chat_template(ctx: Any, requested: str | None) -> ChatTemplate:
    """The template a request renders with: its own ``chat_template`` (400 unless the server trusts
    request templates), else ``--chat-template``'s, else the tokenizer's (``ctx``: a ServingContext)."""
    if requested is not None:
        if not ctx.trust_request_chat_template:
            raise bad_request(
                "This request sends a 'chat_template', which this server runs only when started with "
                "--trust-request-chat-template (a client's template runs in the server). Leave it out to "
                "use the served template (GET /props shows it).",
                param="chat_template",
            )
        if not requested.strip():
            raise bad_request("'chat_template' is empty.", param="chat_template")
        return ChatTemplate(requested, from_request=True)
    return ChatTemplate(ctx.chat_template)


def served_chat_template(ctx: Any) -> str | None:
    """The template a request without its own is rendered with (None: the model has none)."""
    if ctx.chat_template is not None:
        return str(ctx.chat_template)
    own = getattr(ctx.tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: a request renders with "default"
        own = own.get("default")
    return own if isinstance(own, str) else None


def render_error(template: ChatTemplate, e: Exception) -> Exception:
    """The 400 for a template that failed on a request's messages: naming the request's
    ``chat_template`` when it sent the template, else its ``messages``."""
    from jinja2 import TemplateSyntaxError

    if template.from_request:
        what = _syntax(e) if isinstance(e, TemplateSyntaxError) else f"cannot render these messages: {e}"
        return bad_request(f"The request's chat_template {what}", param="chat_template")
    return bad_request(f"The chat template cannot render these messages: {e}", param="messages")


def _syntax(e: Any) -> str:
    return f"does not compile (line {e.lineno}: {e.message})"
