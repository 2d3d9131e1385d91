"""KV-cache events for KV-aware routers: vLLM's ``--kv-events-config`` and its wire format.

The block manager records what enters and leaves its prefix cache; the engine hands each step's
events to a publisher as one batch. Routers (vllm-router ``--policy kv_aware``, llm-d, Dynamo) read
them to learn which replica holds which prefix. On the wire, as vLLM (0.26+) sends them:

* a ZMQ PUB socket sends three frames per batch: the topic, the sequence number (8 bytes,
  big-endian, from 0), and the msgpack payload;
* the payload is the batch as an array ``[ts, [event, ...], data_parallel_rank]``;
* each event is a map tagged by its class name under ``"type"`` (msgspec's ``tag=True``), fields in
  declaration order, optional trailing fields left out while unset (``omit_defaults``);
* a block hash is an unsigned 64-bit int: the last 8 bytes, big-endian, of servelm's sha256 key;
* an optional ROUTER socket replays the buffered batches from a sequence number: a request
  ``[b"", start_seq]`` gets ``[b"", seq, payload]`` per batch, then ``[b"", -1, b""]``.

The publisher owns its sockets on its own thread, so the engine step only appends to a queue.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

log = logging.getLogger(__name__)

MEDIUM_DEVICE = "GPU"  # vLLM names its primary (device) KV pool so on every platform, CPU included
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def external_hash(key: bytes) -> int:
    """A block key as routers take it: vLLM's int form of a hash (last 8 bytes, big-endian)."""
    return int.from_bytes(key[-8:], "big")


@dataclass
class BlockStored:
    """Full blocks entered the prefix cache: a contiguous run of one chain, after ``parent_block_hash``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_DEVICE
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    """Blocks left the prefix cache (evicted for reuse)."""

    block_hashes: list[int]
    medium: str | None = MEDIUM_DEVICE


@dataclass
class AllBlocksCleared:
    """The prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
# Fields vLLM declares without a default: always on the wire, even when None.
_REQUIRED = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}


def event_to_wire(event: KVCacheEvent) -> dict[str, Any]:
    """The tagged map msgspec writes for vLLM's struct of the same name."""
    name = type(event).__name__
    wire: dict[str, Any] = {"type": name}
    for i, f in enumerate(fields(event)):
        value = getattr(event, f.name)
        if i < _REQUIRED[name] or value is not None:
            wire[f.name] = value
    return wire


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int = 0) -> bytes:
    import msgpack

    return msgpack.packb([ts, [event_to_wire(e) for e in events], data_parallel_rank])


DEFAULT_PORT = 5557
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint (brackets stripped); None for ipc:// and inproc://."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def is_wildcard(endpoint: str) -> bool:
    host = endpoint_host(endpoint)
    return host is not None and (host in _WILDCARDS or "*" in host)


def is_local(endpoint: str) -> bool:
    """Reached from this machine only: loopback TCP, or ipc:// / inproc://."""
    host = endpoint_host(endpoint)
    return host is None or host == "localhost" or host == "::1" or host.startswith("127.")


@dataclass
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` JSON, same keys, plus ``bind``; the endpoint's default differs.

    Events carry every prompt's token ids, so without an ``endpoint`` the publisher binds where HTTP
    listens (``host``, port 5557): a loopback server stays loopback. vLLM's default, ``tcp://*:5557``,
    binds every interface; here a wildcard is used only where the operator writes it.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" | "null"; None: zmq when enabled
    endpoint: str | None = None  # None: tcp://HOST:5557, bound
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; more are dropped
    topic: str = ""
    bind: bool | None = None  # servelm's: None is vLLM's rule (bind a wildcard, ipc:// or inproc://; connect to others)

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: unknown publisher {self.publisher!r} (zmq or null)")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config: enable_kv_cache_events must be true or false")
        if self.bind is not None and not isinstance(self.bind, bool):
            raise ValueError("kv_events_config: bind must be true, false or null")
        for name in ("endpoint", "replay_endpoint"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config: {name} must be a string")
        if not isinstance(self.topic, str):
            raise ValueError("kv_events_config: topic must be a string")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config: {name} must be a positive integer")
        if self.endpoint is not None and self.bind is False and is_wildcard(self.endpoint):
            raise ValueError(
                f"kv_events_config: bind is false but {self.endpoint} is a wildcard, which can only be bound"
            )

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @property
    def binds(self) -> bool:
        """Whether the PUB socket binds ``endpoint`` (else it connects to it, e.g. to a broker)."""
        if self.bind is not None:
            return self.bind
        assert self.endpoint is not None
        return is_wildcard(self.endpoint) or self.endpoint.startswith(("ipc://", "inproc://"))

    @classmethod
    def parse(cls, text: str, host: str = "127.0.0.1") -> KVEventsConfig:
        """From the CLI's JSON, the endpoint defaulting to ``host`` (HTTP's); unknown keys are refused
        by name rather than ignored."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events_config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"kv_events_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        cfg = cls(**raw)
        if cfg.endpoint is None:
            cfg.endpoint = f"tcp://[{host}]:{DEFAULT_PORT}" if ":" in host else f"tcp://{host}:{DEFAULT_PORT}"
            if cfg.bind is None:
                cfg.bind = True
        return cfg


def log_exposure(name: str, endpoint: str, bound: bool) -> None:
    """Say where events go; warn when another machine can read them (they carry prompts' token ids)."""
    if is_local(endpoint):
        log.info("KV events: %s %s %s", name, "bound on" if bound else "connected to", endpoint)
    elif is_wildcard(endpoint):
        log.warning(
            "KV events: %s %s listens on all interfaces: any host that reaches it reads every prompt's token ids "
            "(no authentication); name a loopback or private address unless that is intended",
            name,
            endpoint,
        )
    else:
        log.warning(
            "KV events: %s %s %s is not loopback: whoever reads it gets every prompt's token ids",
            name,
            "bound on" if bound else "connected to",
            endpoint,
        )


class ZmqEventPublisher:
    """Publishes event batches on a ZMQ PUB socket, with a replay buffer behind an optional ROUTER."""

    POLL_S = 0.02  # with a replay socket: how long the thread waits on its queue before it looks there

    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.num_published = 0
        self.num_dropped = 0
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:  # a bad or busy endpoint fails start-up, not the first step
            raise self._error

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events as a batch; never blocks (a full queue drops the batch, counted)."""
        if not events:
            return
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1:
                log.warning(
                    "KV events: the publisher queue is full (%d batches); dropping batches", self.config.max_queue_size
                )

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=timeout)
            except queue.Full:
                return  # a daemon thread: it goes with the process
            self._thread.join(timeout)

    # -- the publisher thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        cfg = self.config
        assert cfg.endpoint is not None  # (parse sets it)
        ctx = zmq.Context()
        pub = replay = None
        where = cfg.endpoint
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, cfg.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            if cfg.binds:
                pub.bind(cfg.endpoint)
            else:
                pub.connect(cfg.endpoint)
            log_exposure("publisher", cfg.endpoint, cfg.binds)
            if cfg.replay_endpoint:
                where = cfg.replay_endpoint
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(cfg.replay_endpoint)
                log_exposure("replay socket", cfg.replay_endpoint, True)
        except Exception as e:
            self._error = ValueError(f"kv_events_config: cannot open {where}: {e}")
            for s in (pub, replay):
                if s is not None:
                    s.close(0)
            ctx.term()
            self._started.set()
            return
        self._started.set()
        topic = cfg.topic.encode()
        wait = self.POLL_S if replay is not None else None  # without replay requests, sleep until a batch
        seq = 0
        try:
            while True:
                if replay is not None:
                    while replay.poll(0):
                        self._serve_replay(replay)
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    continue
                if item is None:
                    break
                payload = encode_batch(item[0], item[1])
                pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.num_published += 1
        except Exception:  # the engine goes on serving without events rather than dying with them
            log.exception("KV events: the publisher thread stopped")
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)
            ctx.term()

    def _serve_replay(self, replay: Any) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The publisher ``config`` asks for; None when events are off (the block manager then records nothing)."""
    if config is None or not config.active:
        return None
    return ZmqEventPublisher(config)
