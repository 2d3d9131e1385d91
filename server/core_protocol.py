"""What the API process and the engine-core process (``server.engine_core``) say to each other.

A message is ZMQ frames: a one-byte tag, (to the core) the sending API process's index as digits,
and a payload. The hot path, one message of outputs
per engine step, is msgpack of plain lists (no field names, no prompt: the API process keeps each
request's prompt); the rare control messages (adds, calls and their replies, the start-up facts)
are pickled, because they carry dataclasses, tensors (a LoRA adapter) and exceptions. The channel
is an ``ipc://`` socket in a directory only this user can enter: nothing else can speak on it.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from typing import Any

import msgpack

from servelm.runtime.batch import TokenLogprobs
from servelm.scheduler.outputs import CompletionOutput, RequestOutput

# API process -> engine core
ADD = b"a"  # pickle: (seq, pickle of (arrival_time, options, [(request_id, prompt ids, SamplingParams)]))
ABORT = b"x"  # msgpack: [request_id, ...]
CALL = b"c"  # pickle: (seq, pickle of ("attribute.path", args)): engine.attribute.path(*args), between two steps
STOP = b"s"  # empty: abort what runs and exit 0
CLIENT_GONE = b"g"  # the index of an API process that died (from the first): abort its requests
STOP_CHOICES = b"t"  # msgpack: [request_id, [[choice index, stop string], ...]]: a stop string ended them

# engine core -> API process
READY = b"r"  # pickle: server.engine_info.EngineInfo
OUTPUTS = b"o"  # msgpack: [snapshot, [output, ...]]
REPLY = b"p"  # pickle: (seq, result, error or None, snapshot): an add's or a call's answer
DIED = b"d"  # pickle: str, why the core stops (it exits non-zero after)

Snapshot = tuple[int, int, int]  # running, waiting, used KV blocks


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> Any:
    return pickle.loads(data)


def sendable_params(params: Any) -> Any:
    """``params`` (``SamplingParams``, or an encoder's ``PoolingParams``) without a compiled grammar (a
    native object that does not pickle): the core compiles the same spec again, from its own cache."""
    so = getattr(params, "structured_output", None)
    if so is None or so.compiled is None:
        return params
    return dataclasses.replace(params, structured_output=dataclasses.replace(so, compiled=None))


def sendable_error(exc: BaseException) -> Any:
    """``exc`` as it crosses: its class, ``args`` and attributes (the engine's errors carry what the handlers
    map to a status: ``param``, an adapter's ``name``...), rebuilt without calling its ``__init__``, whose
    arguments are not its ``args``; a class pickle cannot name crosses as a ``RuntimeError`` with its text."""
    try:
        return pickle.loads(pickle.dumps(_ErrorState(type(exc), exc.args, dict(vars(exc)))))
    except Exception:
        return _ErrorState(RuntimeError, (f"{type(exc).__name__}: {exc}",), {})


class _ErrorState:
    def __init__(self, cls: type[BaseException], args: tuple[Any, ...], attrs: dict[str, Any]) -> None:
        self.cls, self.args, self.attrs = cls, args, attrs

    def rebuild(self) -> BaseException:
        exc = self.cls.__new__(self.cls)
        exc.args = self.args
        vars(exc).update(self.attrs)
        return exc


def received_error(state: Any) -> BaseException | None:
    """The exception ``sendable_error`` sent (None for None)."""
    return state.rebuild() if isinstance(state, _ErrorState) else state


def _lp(lp: TokenLogprobs | None) -> list[Any] | None:
    return None if lp is None else [lp.token_id, lp.logprob, lp.rank, lp.top]


def _unlp(v: list[Any]) -> TokenLogprobs:
    return TokenLogprobs(v[0], v[1], v[2], [(t, p) for t, p in v[3]])


def encode_outputs(snapshot: Snapshot, outputs: list[RequestOutput]) -> bytes:
    rows = []
    for o in outputs:
        choices = [
            [
                c.index,
                c.new_token_ids,
                c.new_text,
                None if c.new_logprobs is None else [_lp(lp) for lp in c.new_logprobs],
                c.num_output_tokens,
                c.finish_reason,
                c.stop_reason,
                c.cumulative_logprob,
            ]
            for c in o.outputs
        ]
        plps = None if o.prompt_logprobs is None else [_lp(lp) for lp in o.prompt_logprobs]
        rows.append([o.request_id, choices, o.finished, o.error, plps, o.num_cached_tokens, o.embedding])
    packed: bytes = msgpack.packb([snapshot, rows], use_bin_type=True)
    return packed


def decode_outputs(data: bytes, prompt_of: Callable[[str], list[int]]) -> tuple[Snapshot, list[RequestOutput]]:
    """The step's outputs; ``prompt_of``: a request's prompt ids (the API process keeps them)."""
    snapshot, rows = msgpack.unpackb(data, raw=False, use_list=True)
    outs = []
    for rid, choices, finished, error, plps, cached, embedding in rows:
        completions = [
            CompletionOutput(
                index,
                ids,
                text,
                None if lps is None else [_unlp(lp) for lp in lps],
                num,
                finish,
                stop,
                cum,
            )
            for index, ids, text, lps, num, finish, stop, cum in choices
        ]
        prompt_lps = None if plps is None else [None if lp is None else _unlp(lp) for lp in plps]
        outs.append(RequestOutput(rid, prompt_of(rid), completions, finished, error, prompt_lps, cached, embedding))
    return (snapshot[0], snapshot[1], snapshot[2]), outs


def encode_stopped(request_id: str, stopped: list[tuple[int, str]]) -> bytes:
    packed: bytes = msgpack.packb([request_id, stopped], use_bin_type=True)
    return packed


def decode_stopped(data: bytes) -> tuple[str, list[tuple[int, str]]]:
    rid, stopped = msgpack.unpackb(data, raw=False)
    return rid, [(int(i), str(s)) for i, s in stopped]


def encode_ids(ids: list[str]) -> bytes:
    packed: bytes = msgpack.packb(ids, use_bin_type=True)
    return packed


def decode_ids(data: bytes) -> list[str]:
    return list(msgpack.unpackb(data, raw=False))
