"""What every generation surface does with engine outputs: serialize them, count usage, collect the
choices of a non-streaming answer, and end a stream, however it ends, with its protocol's last word."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from servelm.scheduler.outputs import RequestOutput
from servelm.server.errors import APIError
from servelm.server.protocol import SSE_DONE, sse
from servelm.server.request_group import RequestGroup
from servelm.server.serving_common import check_output_error, output_error

# Proxies must pass events through as they come (nginx buffers unless told not to).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def dumps(obj: Any) -> str:
    """JSON as every surface sends it: compact, and UTF-8 text rather than escapes."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class UsageCounter:
    """The token counts behind one HTTP request's ``usage``: its prompts' tokens, the prefix-cache hits
    of each prompt and the output tokens of each choice (``n`` per prompt), as of the latest output."""

    def __init__(self, prompt_lengths: list[int], n: int) -> None:
        self.n = n
        self.prompt_tokens = sum(prompt_lengths)
        self.cached = [0] * len(prompt_lengths)
        self.output = [0] * (len(prompt_lengths) * n)

    def observe(self, out: RequestOutput, prompt: int = 0) -> None:
        """Take the counts of ``out``, an output of prompt number ``prompt``."""
        self.cached[prompt] = out.num_cached_tokens
        base = prompt * self.n
        for c in out.outputs:
            self.output[base + c.index] = c.num_output_tokens

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached)

    @property
    def completion_tokens(self) -> int:
        return sum(self.output)

    def openai(self, completion_tokens: int | None = None) -> dict[str, Any]:
        """The chat and completions ``usage`` object (``completion_tokens`` overrides the count)."""
        prompt = self.prompt_tokens
        completion = self.completion_tokens if completion_tokens is None else completion_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


async def counted_outputs(
    group: RequestGroup, usage: UsageCounter, prompt_of: Callable[[RequestOutput], int] | None = None
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The group's outputs with the index of the choice their ``c.index`` counts from, each one checked
    for an engine error (raised) and counted into ``usage``; ``prompt_of`` maps an output to its prompt."""
    async for out in group:
        check_output_error(out)
        prompt = prompt_of(out) if prompt_of is not None else 0
        usage.observe(out, prompt)
        yield prompt * usage.n, out


@dataclass
class Choices:
    """A non-streaming answer's choices as they were collected: each one's text pieces, its tokens'
    logprob entries and its finish reason."""

    texts: list[list[str]]
    logprobs: list[list[Any]]
    finish: list[str | None]

    def text(self, i: int) -> str:
        return "".join(self.texts[i])


async def collect_choices(
    group: RequestGroup,
    usage: UsageCounter,
    prompt_of: Callable[[RequestOutput], int] | None = None,
    on_output: Callable[[RequestOutput], None] | None = None,
    keep_text: bool = True,
) -> Choices:
    """Read the group to its end and gather every choice (``keep_text`` False: only finish reasons);
    ``on_output`` sees each output first (prompt logprobs come that way)."""
    num = len(usage.output)
    choices = Choices([[] for _ in range(num)], [[] for _ in range(num)], [None] * num)
    async for base, out in counted_outputs(group, usage, prompt_of):
        if on_output is not None:
            on_output(out)
        for c in out.outputs:
            i = base + c.index
            if keep_text:
                choices.texts[i].append(c.new_text)
                if c.new_logprobs:
                    choices.logprobs[i].extend(c.new_logprobs)
            if c.finish_reason is not None:
                choices.finish[i] = c.finish_reason
    return choices


async def end_on_error(
    events: AsyncIterator[bytes], group: RequestGroup, last_word: Callable[[APIError], bytes], trailer: bytes = b""
) -> AsyncIterator[bytes]:
    """``events``, then, if producing them failed, ``last_word`` for the error (the protocol's own
    terminal event), then ``trailer`` if any; the group is released however the stream ends."""
    try:
        async for event in events:
            yield event
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # reported to the client in-band
        yield last_word(output_error(exc))
    finally:
        group.close()
    if trailer:
        yield trailer


class EventStreamResponse(StreamingResponse):
    """An SSE response that releases its request group however it ends.

    The body generator's own ``finally`` covers disconnects mid-iteration; this covers the case
    where the client vanished before the first chunk was even produced (the generator never ran).
    """

    def __init__(self, body: AsyncIterator[bytes], group: RequestGroup) -> None:
        super().__init__(body, media_type="text/event-stream", headers=SSE_HEADERS)
        self._group = group

    @property
    def group(self) -> RequestGroup:
        """The engine requests behind the stream (a translating stream, Ollama's, releases them too)."""
        return self._group

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._group.close()


def error_chunk(err: APIError) -> bytes:
    """Chat's and completions' in-band error: the error body as one more data event."""
    return sse(dumps(err.body()))


def event_stream(gen: Callable[[], AsyncIterator[bytes]], group: RequestGroup) -> EventStreamResponse:
    """Chat's and completions' SSE response: the chunks, an error event if something fails mid-stream,
    ``[DONE]`` last."""
    return EventStreamResponse(end_on_error(gen(), group, error_chunk, SSE_DONE), group)
