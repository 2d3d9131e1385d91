"""The engine-core process: builds the engine, then only schedules, runs and samples.

``servelm serve`` starts it (``server.engine_process``) and talks to it over two ZMQ sockets
(``server.core_protocol``). Between two steps it takes what the API process sent (adds, aborts,
calls); after each step it sends the step's outputs in one message. Idle, it sleeps in ``poll``.

It ignores SIGINT and SIGTERM: the API process owns shutdown (a terminal's Ctrl-C or systemd's
SIGTERM reach the whole process group, and the drain needs the engine alive). It stops when told
to, when its step fails (it says why, then exits 1), or when the API process is gone (its parent's
sentinel turns readable: exit 1 within the poll interval).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
from typing import Any

import zmq

from servelm.scheduler.config import EngineConfig
from servelm.server import core_protocol as p
from servelm.server.bridge import resolve
from servelm.server.heap import HeapTrimmer, return_free_heap

log = logging.getLogger(__name__)

IDLE_POLL_MS = 500  # an idle core looks for its parent's death this often


def run_engine_core(config: EngineConfig, address_in: str, outputs: list[str], log_level: str) -> None:
    """The core process's main (a spawned child of the first API process): it takes every API process's
    messages on ``address_in`` and answers API process ``i`` on ``outputs[i]``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s",
    )
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(address_in)
    clients = [_Sender(ctx, a) for a in outputs]
    code = 1
    try:
        core = _build(config, clients)
        if core is not None:
            code = core.run(pull)
    finally:
        pull.close(0)
        for c in clients:
            c.close()
        ctx.term()
    sys.exit(code)


class _Sender:
    """The socket to one API process. It connects (the API process binds), so a message for an API process
    not there yet, or gone, is queued rather than blocking the step."""

    def __init__(self, ctx: Any, address: str) -> None:
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # no bound: a slow reader never blocks a step
        self.socket.setsockopt(zmq.LINGER, 2000)  # the last message (DIED) gets out before the exit
        self.socket.connect(address)

    def send(self, frames: list[Any], copy: bool = True) -> None:
        self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)

    def close(self) -> None:
        self.socket.close()


def _build(config: EngineConfig, clients: list[_Sender]) -> EngineCore | None:
    from servelm.metrics.observer import ObserverProxy
    from servelm.server.app import create_prometheus_observer
    from servelm.server.engine_info import engine_info, serving_engine

    proxy = ObserverProxy()
    try:
        engine = serving_engine(config, proxy)
        observer = create_prometheus_observer(engine)
        info = engine_info(engine)
    except Exception as e:  # the API process reports it ("cannot start: ...") and exits 1
        log.debug("engine build failed", exc_info=True)
        clients[0].send([p.DIED, p.dumps(p.sendable_error(e))])
        return None
    proxy.target = observer
    return_free_heap()  # loading's garbage
    clients[0].send([p.READY, p.dumps(info)])  # (the other API processes start after it, with the facts)
    return EngineCore(engine, observer, clients)


class EngineCore:
    """The loop of the core process over one engine."""

    def __init__(self, engine: Any, observer: Any, clients: list[_Sender]) -> None:
        self.engine = engine
        self.observer = observer
        self.clients = clients
        self.client_of: dict[str, int] = {}  # request id -> the API process that sent it
        self.heap = HeapTrimmer()
        parent = multiprocessing.parent_process()
        self.parent_sentinel = parent.sentinel if parent is not None else None

    def snapshot(self) -> p.Snapshot:
        e = self.engine
        return (e.num_running, e.num_waiting, e.block_manager.num_used_blocks)

    def run(self, pull: Any) -> int:
        """Serve until STOP (0), the parent's death or a failed step (1)."""
        engine = self.engine
        watch = getattr(getattr(engine, "runner", None), "watch_workers", None)
        if watch is not None:  # tensor parallelism: a worker's death ends the core (the API process sees it)
            watch(_worker_died)
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        if self.parent_sentinel is not None:
            poller.register(self.parent_sentinel, zmq.POLLIN)
        try:
            while True:
                busy = engine.has_unfinished_requests()
                if not busy:
                    self.heap.idle()
                events = dict(poller.poll(0 if busy else IDLE_POLL_MS))
                if self.parent_sentinel is not None and self.parent_sentinel in events:
                    log.error("the API process is gone: the engine core stops")
                    return 1
                if pull in events and self._take(pull):
                    return 0  # (what still ran was failed by the API process: nobody reads it)
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    if outputs:
                        self._send_outputs(outputs)
                    self.heap.stepped()
        except Exception as e:
            log.exception("the engine core died")
            for c in self.clients:
                c.send([p.DIED, p.dumps(p.sendable_error(e))])
            return 1
        finally:
            close = getattr(getattr(engine, "runner", None), "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # stopping anyway
                    log.exception("closing the runner failed")

    def _send_outputs(self, outputs: list[Any]) -> None:
        """The step's outputs, one message per API process that has some."""
        client_of = self.client_of  # (only requests of API processes after the first are in it)
        if not client_of:
            parts = {0: outputs}
        else:
            parts = {}
            for out in outputs:
                parts.setdefault(client_of.get(out.request_id, 0), []).append(out)
                if out.finished:
                    client_of.pop(out.request_id, None)
        snapshot = self.snapshot()
        for client, outs in parts.items():
            self.clients[client].send([p.OUTPUTS, p.encode_outputs(snapshot, outs)], copy=False)

    def _take(self, pull: Any) -> bool:
        """Apply every message waiting; True on STOP."""
        engine = self.engine
        while True:
            try:
                tag, client_frame, payload = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            client = int(client_frame)
            if tag == p.ABORT:
                for rid in p.decode_ids(payload):
                    self.client_of.pop(rid, None)
                    engine.abort(rid)
            elif tag == p.STOP_CHOICES:
                rid, stopped = p.decode_stopped(payload)
                for index, stop in stopped:
                    engine.stop_choice(rid, index, stop)
            elif tag == p.ADD:
                seq, body = p.loads(payload)
                arrival, options, requests = p.loads(body)
                error = self._add(arrival, options, requests, client)
                self._reply(client, seq, None, error)
            elif tag == p.CALL:
                seq, body = p.loads(payload)
                path, args = p.loads(body)
                try:
                    result, error = self._call(path, args), None
                except Exception as e:  # the call's own failure, reported to its caller
                    result, error = None, p.sendable_error(e)
                if seq >= 0:
                    self._reply(client, seq, result, error)
            elif tag == p.CLIENT_GONE:
                gone = int(payload)
                rids = [rid for rid, c in self.client_of.items() if c == gone]
                log.warning("API process %d is gone: aborting its %d request(s)", gone, len(rids))
                for rid in rids:
                    del self.client_of[rid]
                    engine.abort(rid)
            elif tag == p.STOP:
                return True

    def _add(self, arrival: float, options: dict[str, Any], requests: list[Any], client: int) -> Any:
        added: list[str] = []
        for rid, ids, params in requests:
            try:
                self.engine.add_request(rid, ids, params, arrival_time=arrival, **options)
            except Exception as e:  # the request is bad, not the engine: all of the group or none
                for done in added:
                    self.client_of.pop(done, None)
                    self.engine.abort(done)
                return p.sendable_error(e)
            added.append(rid)
            if client:
                self.client_of[rid] = client
        return None

    def _call(self, path: str, args: tuple[Any, ...]) -> Any:
        if path == "metrics":
            from servelm.metrics.prometheus import render_metrics

            return render_metrics(getattr(self.observer, "registry", None))
        if path == "on_request_rejected":
            return self.observer.on_request_rejected() if self.observer is not None else None
        return resolve(self.engine, path)(*args)

    def _reply(self, client: int, seq: int, result: Any, error: BaseException | None) -> None:
        try:
            payload = p.dumps((seq, result, error, self.snapshot()))
        except Exception as e:  # a result that does not pickle: its caller gets why
            payload = p.dumps((seq, None, RuntimeError(f"the result does not cross processes: {e}"), self.snapshot()))
        self.clients[client].send([p.REPLY, payload])


def _worker_died(exc: BaseException) -> None:
    # From the tensor-parallel watcher thread, while the engine thread may wait on a collective forever.
    log.error("a tensor-parallel worker died (%s): the engine core stops", exc)
    logging.shutdown()
    os._exit(1)
