"""KV events from an embedded Store, read as a router reads vLLM's: real ZMQ sockets on
ipc:// and loopback tcp, every batch decoded by vLLM's own msgspec classes."""

import threading

import numpy as np
import pytest
import zmq

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kvstore import Namespace, Store
from kvstore._events import block_hash
from kvstore.config import load_config
from kvstore.errors import ConfigError, InvalidArgumentError
from tests._events_sub import Subscriber, flat

BLOCK = 4096
CHUNK = 4


def events_config(tmp_path, **extra):
    return {"endpoint": f"ipc://{tmp_path}/pub", "replay_endpoint": f"ipc://{tmp_path}/replay",
            "topic": "kv", **extra}


def two_tier(tmp_path, top_blocks=2, **events):
    return Store.from_config({
        "tiers": [{"name": "hot", "kind": "dram", "capacity": top_blocks * BLOCK},
                  {"name": "warm", "kind": "dram", "capacity": 16 * BLOCK}],
        "io_threads": 2, "events": events_config(tmp_path, **events)})


def prompt(n_chunks, salt=""):
    tokens = np.arange(n_chunks * CHUNK) + 1000
    keys = Namespace(model="m", dtype="u8", chunk_tokens=CHUNK, salt=salt).chunk_keys(tokens)
    chunks = [tokens[i * CHUNK:(i + 1) * CHUNK].tolist() for i in range(n_chunks)]
    return keys, chunks, [np.full(BLOCK, i + 1, np.uint8) for i in range(n_chunks)]


def everything(store, sub):
    """Every batch published so far, through the replay socket."""
    assert store._events.flush()
    return sub.replay(0)


def test_store_evict_delete_clear_in_vllm_format(tmp_path):
    with two_tier(tmp_path) as store:
        sub = Subscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", topic="kv")
        try:
            keys, chunks, srcs = prompt(3)
            assert store.save(keys[:2], srcs[:2], token_ids=chunks[:2]).result() == [True, True]
            batches = everything(store, sub)
            assert [topic for topic, _, _ in batches] == [b"kv"] * len(batches)
            assert [seq for _, seq, _ in batches] == list(range(len(batches)))
            (stored,) = flat(batches)
            assert isinstance(stored, BlockStored)
            assert stored.medium == "hot" and stored.parent_block_hash is None
            assert stored.block_hashes == [block_hash(k.digest) for k in keys[:2]]
            assert stored.block_hashes[0] == int.from_bytes(keys[0].digest[-8:], "big")
            assert stored.token_ids == chunks[0] + chunks[1] and stored.block_size == CHUNK

            # a third block evicts the oldest from "hot" into "warm"
            assert store.save(keys[2:], srcs[2:], token_ids=chunks[2:]).result() == [True]
            events = flat(everything(store, sub))[1:]
            removed = [e for e in events if isinstance(e, BlockRemoved)]
            stored = [e for e in events if isinstance(e, BlockStored)]
            assert [(e.medium, e.block_hashes) for e in removed] == [("hot", [block_hash(keys[0].digest)])]
            assert {(e.medium, tuple(e.block_hashes)) for e in stored} == {
                ("warm", (block_hash(keys[0].digest),)), ("hot", (block_hash(keys[2].digest),))}
            spilled = next(e for e in stored if e.medium == "warm")
            assert spilled.token_ids == chunks[0] and spilled.parent_block_hash is None
            newest = next(e for e in stored if e.medium == "hot")
            assert newest.parent_block_hash == block_hash(keys[1].digest) and newest.token_ids == chunks[2]
            assert [t["blocks"] for t in store.stats()["tiers"]] == [2, 1]

            before = len(flat(everything(store, sub)))
            assert store.delete([keys[0], keys[1]]) == 2
            events = flat(everything(store, sub))[before:]
            assert sorted((e.medium, tuple(e.block_hashes)) for e in events) == sorted([
                ("hot", (block_hash(keys[1].digest),)), ("warm", (block_hash(keys[0].digest),))])

            assert store.clear() == 1
            last = flat(everything(store, sub))[-1]
            assert isinstance(last, AllBlocksCleared)
            stats = store.stats()["events"]
            assert stats["sequence"] == len(everything(store, sub)) - 1 and stats["queued"] == 0
            assert stats["tokens_missing"] == 0 and stats["cleared"] == 1
        finally:
            sub.close()


def test_live_subscriber_sees_what_replay_keeps_and_replays_missed_sequence_numbers(tmp_path):
    with two_tier(tmp_path, top_blocks=8) as store:
        sub = Subscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", topic="kv")
        try:
            # a SUB socket joins asynchronously: save until the first batch arrives live
            live, n = None, 0
            while live is None:
                assert n < 50, "the subscriber never received a live batch"
                keys, chunks, srcs = prompt(1, salt=f"probe{n}")
                store.save(keys, srcs, token_ids=chunks).result()
                store._events.flush()
                live, n = sub.live(timeout_ms=200), n + 1
            first_seq = store.stats()["events"]["sequence"]
            while live[1] < first_seq:       # batches of earlier probes still on their way
                live = sub.live()
            for i in range(5):   # one batch each: reports waiting together are sent as one batch
                keys, chunks, srcs = prompt(1, salt=f"after{i}")
                store.save(keys, srcs, token_ids=chunks).result()
                store._events.flush()
            got = [sub.live() for _ in range(5)]
            assert [seq for _, seq, _ in got] == list(range(first_seq + 1, first_seq + 6))
            # the router lost batches first_seq+2.. (say): it asks for them by number
            missed = sub.replay(first_seq + 2)
            assert [seq for _, seq, _ in missed] == list(range(first_seq + 2, first_seq + 6))
            assert [b.events for _, _, b in missed] == [b.events for _, _, b in got[1:]]
            assert sub.replay(first_seq + 100) == []
        finally:
            sub.close()


def test_late_subscriber_catches_up_by_replay_within_buffer_steps(tmp_path):
    with two_tier(tmp_path, top_blocks=8, buffer_steps=3) as store:
        for i in range(5):     # nobody listens yet; one batch per save (flushed one by one)
            keys, chunks, srcs = prompt(1, salt=f"early{i}")
            store.save(keys, srcs, token_ids=chunks).result()
            assert store._events.flush()
        sub = Subscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", topic="kv")
        try:
            assert sub.live(timeout_ms=200) is None       # what was sent before it joined is gone
            kept = sub.replay(0)
            assert [seq for _, seq, _ in kept] == [2, 3, 4]   # buffer_steps batches kept
            assert all(isinstance(e, BlockStored) and e.medium == "hot" for e in flat(kept))
        finally:
            sub.close()


def test_publisher_connects_to_a_router_that_binds_on_loopback_tcp(tmp_path):
    sub = Subscriber("tcp://127.0.0.1:*", bind=True)
    try:
        config = {"tiers": [{"name": "only", "kind": "dram", "capacity": 8 * BLOCK}],
                  "events": {"endpoint": sub.endpoint}}
        with Store.from_config(config) as store:
            live, n = None, 0
            while live is None:
                assert n < 50, "the bound subscriber never received a batch"
                keys, _, srcs = prompt(1, salt=f"tcp{n}")
                store.save(keys, srcs).result()     # no token ids: counted, placeholder fields
                store._events.flush()
                live, n = sub.live(timeout_ms=200), n + 1
            topic, _, batch = live
            (ev,) = batch.events
            assert topic == b"" and ev.token_ids == [] and ev.block_size == 0 and ev.medium == "only"
            assert store.stats()["events"]["tokens_missing"] >= 1
    finally:
        sub.close()


def test_a_store_without_events_publishes_nothing():
    with Store.from_config({"tiers": [{"name": "only", "kind": "dram", "capacity": 4 * BLOCK}]}) as store:
        keys, chunks, srcs = prompt(2)
        assert store.save(keys, srcs, token_ids=chunks).result() == [True, True]
        assert store._events is None and "events" not in store.stats()


def test_token_ids_must_match_the_keys(tmp_path):
    with two_tier(tmp_path) as store:
        keys, chunks, srcs = prompt(2)
        with pytest.raises(InvalidArgumentError, match="token id lists"):
            store.save(keys, srcs, token_ids=chunks[:1])


def test_bad_event_config_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="events.endpoint"):
        load_config({"tiers": [{"name": "a", "kind": "dram", "capacity": BLOCK}],
                     "events": {"endpoint": "http://127.0.0.1:5557"}})
    taken = zmq.Context.instance().socket(zmq.PUB)
    taken.bind("tcp://127.0.0.1:*")
    try:
        endpoint = taken.getsockopt_string(zmq.LAST_ENDPOINT)
        with pytest.raises(ConfigError, match="events.replay_endpoint"):
            Store.from_config({"tiers": [{"name": "a", "kind": "dram", "capacity": BLOCK}],
                               "events": {"endpoint": f"ipc://{tmp_path}/p", "replay_endpoint": endpoint}})
    finally:
        taken.close(linger=0)


def test_token_ids_must_be_integers(tmp_path):
    with two_tier(tmp_path) as store:
        keys, chunks, srcs = prompt(1)
        with pytest.raises(InvalidArgumentError, match="token_ids"):
            store.save(keys, srcs, token_ids=[[1.5, 2.0, 3.0, 4.0]])


def test_a_queue_overflow_becomes_one_all_blocks_cleared(tmp_path):
    with two_tier(tmp_path, top_blocks=16, max_queue=3) as store:
        publisher = store._events
        sending, release = threading.Event(), threading.Event()
        real_send = publisher._send

        def held_send(payload, num_events):     # hold the publisher thread in its first send
            sending.set()
            assert release.wait(10)
            real_send(payload, num_events)

        publisher._send = held_send
        sub = Subscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", topic="kv")
        try:
            keys, chunks, srcs = prompt(6)
            store.save(keys[:1], srcs[:1], token_ids=chunks[:1]).result()
            assert sending.wait(10)
            for j in range(1, 6):           # five reports while three fit: the queue collapses
                store.save(keys[j:j + 1], srcs[j:j + 1], token_ids=chunks[j:j + 1]).result()
            waiting = store.stats()["events"]
            assert waiting["queued"] >= 2 and waiting["lag_s"] > 0    # one held in the send, the rest queued
            publisher._send = real_send
            release.set()
            events = flat(everything(store, sub))
            assert isinstance(events[0], BlockStored) and events[0].block_hashes == [block_hash(keys[0].digest)]
            cleared = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
            assert len(cleared) == 1
            after = [h for e in events[cleared[0] + 1:] for h in e.block_hashes]
            assert after == [block_hash(k.digest) for k in keys[-(len(after)):]] and 1 <= len(after) < 5
            assert store.stats()["events"]["overflows"] == 1
        finally:
            release.set()
            sub.close()


def test_the_event_stream_rebuilds_every_tier_after_random_work(tmp_path):
    """A router folding every event (replayed from 0) holds exactly what each tier holds,
    after saves, promoting loads, spills through three tiers, deletes and a clear, from
    two threads at once."""
    config = {"tiers": [{"name": "t0", "kind": "dram", "capacity": 4 * BLOCK},
                        {"name": "t1", "kind": "dram", "capacity": 8 * BLOCK},
                        {"name": "t2", "kind": "dram", "capacity": 12 * BLOCK}],
              "io_threads": 2, "events": events_config(tmp_path, buffer_steps=100_000)}
    with Store.from_config(config) as store:
        def work(seed):
            rng = np.random.default_rng(seed)
            for step in range(120):
                keys, chunks, srcs = prompt(int(rng.integers(1, 4)), salt=f"{seed}-{int(rng.integers(0, 12))}")
                op = rng.random()
                if op < 0.55:
                    store.save(keys, srcs, token_ids=chunks).result()
                elif op < 0.85:
                    store.load(keys, [np.empty(BLOCK, np.uint8) for _ in keys]).result()
                elif op < 0.98:
                    store.delete(keys)
                else:
                    store.clear()

        threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        sub = Subscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", topic="kv")
        try:
            held = {"t0": set(), "t1": set(), "t2": set()}
            for event in flat(everything(store, sub)):
                if isinstance(event, BlockStored):
                    held[event.medium].update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    held[event.medium].difference_update(event.block_hashes)
                else:
                    for hashes in held.values():
                        hashes.clear()
            actual = {t.name: {block_hash(k.digest) for k in t.keys()} for t in store.tiers}
            assert held == actual
            assert sum(len(v) for v in actual.values()) > 0
            tiers = store.stats()["tiers"]
            assert tiers[0]["spills"] and tiers[1]["spills"] and tiers[2]["evictions"] and tiers[0]["promotions"]
        finally:
            sub.close()


def test_blocks_recovered_from_a_persistent_tier_are_published_at_start(tmp_path):
    config = {"tiers": [{"name": "disk", "kind": "nvme", "path": str(tmp_path / "nvme"), "capacity": "1MiB",
                         "direct_io": False, "file_bytes": "1MiB"}]}
    keys, chunks, srcs = prompt(3)
    with Store.from_config(config) as store:
        assert store.save(keys, srcs).result() == [True] * 3
    with Store.from_config({**config, "events": events_config(tmp_path)}) as store:
        sub = Subscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", topic="kv")
        try:
            events = flat(everything(store, sub))
            assert all(isinstance(e, BlockStored) and e.medium == "disk" for e in events)
            assert sorted(h for e in events for h in e.block_hashes) == sorted(block_hash(k.digest) for k in keys)
        finally:
            sub.close()


@pytest.mark.redis
def test_blocks_found_in_a_shared_tier_are_reported_stored_there(tmp_path_factory, tmp_path):
    """A node that finds another node's blocks in a shared tier (a lookup asks Redis)
    publishes them stored in that tier, as if it had written them."""
    pytest.importorskip("redis", reason="redis-py is installed by scripts/deps/00-python.sh")
    from tests._redis import running_redis

    servers = running_redis(tmp_path_factory, "events-shared")
    server = next(servers)
    try:
        shared = {"name": "shared", "kind": "redis", "url": server.url, "capacity": 16 * BLOCK, "prefix": "ev"}
        writer = Store.from_config({"tiers": [dict(shared)]})
        reader = Store.from_config({"tiers": [{"name": "hot", "kind": "dram", "capacity": 4 * BLOCK}, shared],
                                    "events": events_config(tmp_path)})
        sub = Subscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", topic="kv")
        try:
            keys, _, srcs = prompt(2, salt="found")
            assert writer.save(keys, srcs).result() == [True, True]
            assert reader.lookup(keys) == 2
            events = flat(everything(reader, sub))
            stored = [e for e in events if isinstance(e, BlockStored)]
            assert [(e.medium, e.block_hashes) for e in stored] == [("shared", [block_hash(k.digest) for k in keys])]
        finally:
            sub.close()
            reader.close()
            writer.close()
    finally:
        servers.close()
