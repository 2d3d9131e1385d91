"""What one request may carry: bounds checked at the edge, before any work is spent on the request.

Each bound keeps one request's cost near its own share (event-loop time to validate it, tokenizer-thread
time, memory kept, engine work per step); the README's errors paragraph lists them. Bounds on sampling
parameters the engine also checks live with ``SamplingParams``; the text and sequence bounds that
depend on the served model are checked by ``ServingContext``.

Every request body is first walked once (``RequestBody``): each string and key must be Unicode text
(no lone surrogate: the tokenizer, the grammar compiler and the JSON encoder all refuse one, which
surfaced as 500s), and the body's nesting and size in JSON values are bounded, so that neither this
walk nor the model validation after it (about 3 us per object: a million small messages took 3 s of
the event loop) nor any recursive code later (``json.dumps``, the chat template) can be made slow or
overflow by one body.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, model_validator
from pydantic_core import PydanticCustomError

# Nesting of JSON arrays and objects: a JSON schema at OpenAI's 10 levels of objects takes about 40.
MAX_JSON_DEPTH = 64
# List items and object members in one body, integer lists (token ids) aside: pydantic checks those at
# C speed, where each other value costs microseconds. Generous: 2048 messages of a few parts are ~30k.
MAX_JSON_ITEMS = 65536
# Chat messages (and Responses input items) per request: each is a model object and a template turn.
MAX_MESSAGES = 2048
# Content parts per message, and earlier tool calls per assistant message.
MAX_CONTENT_PARTS = 256
MAX_TOOL_CALLS = 128
# OpenAI's metadata bounds: 16 pairs, keys of at most 64 characters, values of at most 512.
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
# LoRA adapter names (listed by /v1/models and in a metric's labels) and folder paths.
MAX_LORA_NAME_CHARS = 256
MAX_PATH_CHARS = 4096

_SURROGATE = re.compile("[\ud800-\udfff]")


def _surrogate(s: str) -> str | None:
    """The lone surrogate that makes ``s`` no Unicode text, described; None if there is none."""
    m = None if s.isascii() else _SURROGATE.search(s)
    if m is None:
        return None
    return (
        f"a lone surrogate (U+{ord(m.group()):04X} at character {m.start()}), half of a UTF-16 pair and no "
        "character: strings must be Unicode text"
    )


def _int_list(items: list[Any]) -> bool:
    """Whether ``items`` holds only integers (at C speed: a sum stays an int only over ints)."""
    try:
        return type(sum(items)) is int
    except TypeError:
        return False


class _Walk:
    """One pass over a parsed JSON body: the first string that is not Unicode text, or the first place
    where the body nests too deep or holds too many values."""

    def __init__(self) -> None:
        self.items = 0

    def check(self, value: Any, depth: int) -> tuple[list[str | int], str] | None:
        """(the path to the problem, innermost part first; the problem), or None."""
        if type(value) is str:
            problem = _surrogate(value)
            return ([], f"it holds {problem}") if problem else None
        if depth >= MAX_JSON_DEPTH:
            return [], f"arrays and objects nest deeper than {MAX_JSON_DEPTH} levels here"
        if type(value) is list:
            if _int_list(value):
                return None
            entries: Any = enumerate(value)
        else:
            for key in value:
                problem = _surrogate(key) if type(key) is str else None
                if problem:
                    return [], f"a key holds {problem}"
            entries = value.items()
        self.items += len(value)
        if self.items > MAX_JSON_ITEMS:
            return [], f"the request holds more than {MAX_JSON_ITEMS} list items and object members"
        for key, item in entries:
            if type(item) in (str, list, dict):
                found = self.check(item, depth + 1)
                if found is not None:
                    found[0].append(key)
                    return found
        return None


def body_problem(body: Any) -> tuple[str | None, str] | None:
    """(the field path, e.g. ``messages[0].content``; the problem) for a body ``RequestBody`` refuses."""
    if type(body) not in (list, dict):
        return None
    found = _Walk().check(body, 0)
    if found is None:
        return None
    path = ""
    for part in reversed(found[0]):
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path or None, found[1]


class RequestBody(BaseModel):
    """A request body model: the body is walked once (``body_problem``) before its fields are validated."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_and_bounded(cls, data: Any) -> Any:
        found = body_problem(data)
        if found is not None:
            # ``param`` names the field (errors.validation_error): the error's loc is the body itself.
            raise PydanticCustomError("invalid_body_value", "{problem}", {"param": found[0], "problem": found[1]})
        return data


def check_metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's bounds on ``metadata`` (a field validator)."""
    if value is None:
        return None
    if len(value) > MAX_METADATA_PAIRS:
        raise ValueError(f"'metadata' holds at most {MAX_METADATA_PAIRS} key-value pairs, got {len(value)}.")
    for k, v in value.items():
        if len(k) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"'metadata' keys are at most {MAX_METADATA_KEY_CHARS} characters, got one of {len(k)}.")
        if isinstance(v, str) and len(v) > MAX_METADATA_VALUE_CHARS:
            raise ValueError(
                f"'metadata' values are at most {MAX_METADATA_VALUE_CHARS} characters, got one of {len(v)}."
            )
    return value
