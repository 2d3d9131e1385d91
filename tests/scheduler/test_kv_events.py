"""KV-cache events (vLLM's --kv-events-config): what the block manager records, decoded from a real
pyzmq SUB socket the way vLLM 0.26+ consumers read it (batch = [ts, events, dp_rank], events =
maps tagged by "type"), plus sequence numbers and the replay socket."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq
from block_seq import Seq, compute
from listening import listening_addresses

from servelm.scheduler.block_manager import BlockManager
from servelm.scheduler.kv_events import END_SEQ, KVEventsConfig, ZmqEventPublisher, external_hash, make_publisher

BS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def endpoints() -> Iterator[tuple[ZmqEventPublisher, Any, str]]:
    """A publisher on loopback with a replay socket, and a SUB socket that already receives from it."""
    port, replay_port = free_port(), free_port()
    cfg = KVEventsConfig.parse(
        f'{{"enable_kv_cache_events": true, "bind": true, "endpoint": "tcp://127.0.0.1:{port}", '
        f'"replay_endpoint": "tcp://127.0.0.1:{replay_port}", "topic": "kv"}}'
    )
    pub = make_publisher(cfg)
    assert isinstance(pub, ZmqEventPublisher)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # PUB drops what it sends before the subscription arrives (ZMQ's slow joiner)
    yield pub, sub, f"tcp://127.0.0.1:{replay_port}"
    sub.close(0)
    ctx.term()
    pub.shutdown()


def receive(sub: Any) -> tuple[int, list[dict[str, Any]]]:
    topic, seq, payload = sub.recv_multipart()
    assert topic == b"kv" and len(seq) == 8
    batch = msgpack.unpackb(payload)
    ts, events, rank = batch  # vLLM's EventBatch is array_like: [ts, events, data_parallel_rank]
    assert isinstance(ts, float) and abs(ts - time.time()) < 60 and rank == 0
    return int.from_bytes(seq, "big"), events


def stored(hashes: list[bytes], parent: bytes | None, tokens: list[int]) -> dict[str, Any]:
    """The map vLLM's BlockStored encodes to (required fields always present, in order)."""
    return {
        "type": "BlockStored",
        "block_hashes": [external_hash(h) for h in hashes],
        "parent_block_hash": None if parent is None else external_hash(parent),
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def test_events_follow_the_prefix_cache(endpoints: tuple[ZmqEventPublisher, Any, str]) -> None:
    pub, sub, _ = endpoints
    bm = BlockManager(num_blocks=6, block_size=BS, kv_events=True)

    # A 10-token prompt fills 2 blocks: one BlockStored with both, chained from no parent.
    a = Seq(0, list(range(10)))
    assert compute(bm, a, 10)
    pub.publish(bm.take_events())
    seq, events = receive(sub)
    assert seq == 0 and events == [stored(a.block_hashes, None, a.token_ids[:8])]
    assert list(events[0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]

    # A second prompt sharing those 8 tokens adopts them (no event) and stores only its own 3rd block,
    # whose parent is the shared 2nd block.
    b = Seq(1, list(range(8)) + [50, 51, 52, 53, 54])
    assert compute(bm, b, 13 - 8, bm.lookup(b))
    assert b.block_table[:2] == a.block_table[:2]
    pub.publish(bm.take_events())
    seq, events = receive(sub)
    assert seq == 1 and events == [stored(b.block_hashes[2:3], a.block_hashes[1], b.token_ids[8:12])]

    # Nothing new cached: no batch (the step publishes nothing).
    assert bm.take_events() == []
    pub.publish([])

    # Both finish: their blocks stay cached (no event); a new 6-block prompt evicts the 3 cached
    # ones (LRU, a chain's tail first), each a BlockRemoved, then stores its own full blocks.
    bm.free(a)
    bm.free(b)
    c = Seq(2, list(range(100, 124)))
    assert compute(bm, c, 24)
    pub.publish(bm.take_events())
    seq, events = receive(sub)
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert seq == 2 and all(e["medium"] == "GPU" for e in events if e["type"] == "BlockRemoved")
    assert sorted(removed) == sorted(external_hash(h) for h in a.block_hashes[:2] + b.block_hashes[2:3])
    assert events[-1] == stored(c.block_hashes, None, c.token_ids)

    # A reset forgets every prefix: AllBlocksCleared, a bare tagged map.
    bm.reset_prefix_cache()
    pub.publish(bm.take_events())
    seq, events = receive(sub)
    assert seq == 3 and events == [{"type": "AllBlocksCleared"}]
    bm.check_invariants()


def test_duplicate_blocks_split_the_stored_run(endpoints: tuple[ZmqEventPublisher, Any, str]) -> None:
    """Two prompts computed together: the second's copy of a block another registered first stays
    private, so its stored blocks are two runs, each with its true parent."""
    pub, sub, _ = endpoints
    bm = BlockManager(num_blocks=8, block_size=BS, kv_events=True)
    a, b = Seq(0, list(range(4)) + [7] * 4), Seq(1, list(range(4)) + [9] * 8)
    assert bm.allocate_slots(a, 8) and bm.allocate_slots(b, 12)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    b.num_computed_tokens = 12
    bm.cache_full_blocks(b)
    pub.publish(bm.take_events())
    _, events = receive(sub)
    assert events == [
        stored(a.block_hashes, None, a.token_ids),
        stored(b.block_hashes[1:], b.block_hashes[0], b.token_ids[4:]),
    ]


def test_replay_resends_from_a_sequence_number(endpoints: tuple[ZmqEventPublisher, Any, str]) -> None:
    pub, sub, replay_endpoint = endpoints
    bm = BlockManager(num_blocks=8, block_size=BS, kv_events=True)
    for i in range(3):
        assert compute(bm, Seq(i, [i] * 8), 8)
        pub.publish(bm.take_events())
    live = [receive(sub) for _ in range(3)]
    assert [s for s, _ in live] == [0, 1, 2]

    ctx = zmq.Context()
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVTIMEO, 5000)
    req.connect(replay_endpoint)
    req.send_multipart((b"", (1).to_bytes(8, "big")))
    replayed = []
    while True:
        empty, seq, payload = req.recv_multipart()
        assert empty == b""
        if seq == END_SEQ:
            assert payload == b""
            break
        replayed.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]))
    req.close(0)
    ctx.term()
    assert replayed == live[1:]


def test_disabled_records_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    assert compute(bm, Seq(0, list(range(8))), 8)
    bm.reset_prefix_cache()
    assert bm.take_events() == []
    assert make_publisher(None) is None
    assert make_publisher(KVEventsConfig.parse('{"enable_kv_cache_events": false}')) is None
    assert make_publisher(KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}')) is None


def test_config_is_vllms_json() -> None:
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert (cfg.publisher, cfg.endpoint, cfg.replay_endpoint, cfg.topic) == ("zmq", "tcp://127.0.0.1:5557", None, "")
    assert (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) == (10_000, 100_000, 100_000)
    for bad, needle in [
        ('{"enable_kv_cache_events": true, "endpont": "x"}', "endpont"),
        ('{"publisher": "kafka"}', "kafka"),
        ('{"enable_kv_cache_events": true, "hwm": 0}', "hwm"),
        ('{"enable_kv_cache_events": true, "buffer_steps": true}', "buffer_steps"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
        ('{"enable_kv_cache_events": true, "endpoint": 5557}', "endpoint"),
        ("[1]", "object"),
        ("{", "JSON"),
    ]:
        with pytest.raises(ValueError, match=needle):
            KVEventsConfig.parse(bad)
    # A busy endpoint fails at start-up, by name.
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        busy = f"tcp://127.0.0.1:{port}"
        with pytest.raises(ValueError, match=busy):
            make_publisher(
                KVEventsConfig(
                    enable_kv_cache_events=True,
                    endpoint=f"tcp://127.0.0.1:{free_port()}",
                    bind=True,
                    replay_endpoint=busy,
                )
            )


def test_events_replayed_into_an_index_match_the_cache() -> None:
    """A router's view (events applied in order) equals the cache after every step of a random workload
    with shared prefixes, evictions, aborts and resets."""
    import random

    rng = random.Random(7)
    bm = BlockManager(num_blocks=12, block_size=BS, kv_events=True)
    view: set[int] = set()
    live: list[Seq] = []
    for step in range(400):
        op = rng.random()
        if op < 0.45 and len(live) < 4:
            prefix = rng.choice([[1, 2, 3, 4, 5, 6, 7, 8], [9] * 4, []])
            s = Seq(step, prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 14))])
            match = bm.lookup(s)
            if bm.allocate_slots(s, len(s.token_ids) - match.num_cached_tokens, match):
                s.num_computed_tokens = len(s.token_ids)
                bm.cache_full_blocks(s)
                live.append(s)
        elif op < 0.75 and live:
            s = rng.choice(live)  # decode a token
            s.token_ids.append(rng.randrange(50))
            if bm.allocate_slots(s, 1):
                s.num_computed_tokens += 1
                bm.cache_full_blocks(s)
        elif op < 0.98 and live:
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            bm.reset_prefix_cache()
        for e in bm.take_events():
            if e.__class__.__name__ == "BlockStored":
                view.update(e.block_hashes)
            elif e.__class__.__name__ == "BlockRemoved":
                assert set(e.block_hashes) <= view
                view.difference_update(e.block_hashes)
            else:
                view.clear()
        assert view == {external_hash(h) for h in bm._cached}, step
        bm.check_invariants()


def test_engine_publishes_one_batch_per_step(tiny_llama_dir: Any) -> None:
    """A real engine (tiny random Llama) with --kv-events-config: two prompts sharing 32 tokens."""
    from servelm.scheduler.config import EngineConfig
    from servelm.scheduler.engine import Engine
    from servelm.scheduler.sampling_params import SamplingParams

    port = free_port()
    cfg = EngineConfig(
        model=str(tiny_llama_dir),
        kv_cache_memory=2 * 2**20,
        max_model_len=256,
        block_size=16,
        kv_events_config=f'{{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:{port}", "bind": true}}',
    )
    engine = Engine(cfg)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 1000)  # the publisher sends within milliseconds; then the stream is done
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)
    try:
        shared = list(range(10, 42))
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        engine.generate([shared + [7, 8, 9]], params)
        engine.generate([shared + [5] * 20], params)
        batches = []
        while True:
            try:
                batches.append(receive_any(sub))
            except zmq.Again:
                break
    finally:
        sub.close(0)
        ctx.term()
        assert engine.kv_events is not None
        engine.kv_events.shutdown()
    assert [s for s, _ in batches] == list(range(len(batches)))
    events = [e for _, evs in batches for e in evs]
    # The first prompt caches its 2 full blocks; the second adopts them and caches its 3rd, whose
    # parent is the shared 2nd block and whose tokens are its own.
    first, second = events[0], events[1]
    assert first["token_ids"] == shared and first["parent_block_hash"] is None and first["block_size"] == 16
    assert second["parent_block_hash"] == first["block_hashes"][1] and second["token_ids"] == [5] * 16
    assert all(e["type"] == "BlockStored" for e in events)


def receive_any(sub: Any) -> tuple[int, list[dict[str, Any]]]:
    _, seq, payload = sub.recv_multipart()
    return int.from_bytes(seq, "big"), msgpack.unpackb(payload)[1]


def test_events_bind_the_http_host_by_default() -> None:
    """Without an endpoint the publisher binds where HTTP listens: loopback stays loopback (KV events
    carry every prompt's token ids; vLLM's default, tcp://*:5557, hands them to the whole network)."""
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true}', host="127.0.0.1")
    assert (cfg.endpoint, cfg.bind) == ("tcp://127.0.0.1:5557", True)
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true}', host="::1").endpoint == "tcp://[::1]:5557"
    port = free_port()
    pub = make_publisher(
        KVEventsConfig.parse(f'{{"enable_kv_cache_events": true, "bind": true, "endpoint": "tcp://127.0.0.1:{port}"}}')
    )
    try:
        assert listening_addresses(port) == {"127.0.0.1"}
    finally:
        pub.shutdown()


def test_a_non_loopback_endpoint_is_logged_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    port, replay = free_port(), free_port()
    cfg = KVEventsConfig.parse(
        f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{port}", "replay_endpoint": "tcp://*:{replay}"}}',
        host="127.0.0.1",
    )
    with caplog.at_level("INFO", logger="servelm.scheduler.kv_events"):
        pub = make_publisher(cfg)
        pub.shutdown()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(f"tcp://*:{port}" in m and "all interfaces" in m for m in warned), warned
    assert any(f"tcp://*:{replay}" in m for m in warned), warned
    assert listening_addresses(port) == set()  # closed again
    caplog.clear()
    with caplog.at_level("INFO", logger="servelm.scheduler.kv_events"):
        pub = make_publisher(KVEventsConfig.parse('{"enable_kv_cache_events": true}', host="127.0.0.1"))
        pub.shutdown()
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("tcp://127.0.0.1:5557" in r.getMessage() for r in caplog.records)


def test_a_wildcard_is_refused_unless_named() -> None:
    """A wildcard endpoint is taken only as written by the operator; bind=false on one is a contradiction."""
    with pytest.raises(ValueError, match="bind"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "bind": false}')
    with pytest.raises(ValueError, match="bind"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "bind": "yes"}')
