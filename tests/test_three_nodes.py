"""Three nodes in one test (issue 21): three ``kvstore serve`` processes, each with its
own data directory and ports and the same tier stack (DRAM + NVMe, then a shared redis
tier over one 3-master Redis Cluster, then an S3 tier on one Swift bucket), every
service a real process on loopback, started and stopped by PID.

- A block saved through node A and evicted from A's own tiers (DRAM, NVMe) is found and
  loaded byte-exact through node C, which was already running when A saved it (C's
  Store asks the shared tiers about keys its index does not hold).
- Node B is killed (SIGKILL): A and C keep serving, and the blocks B had pushed into
  the shared tiers are still loaded through C.
- ``POST /v1/lookup`` on C reports the prefix it now holds.
"""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from kvstore import Namespace
from kvstore.client import Client
from tests._redis import running_cluster
from tests._servers import ProcessServer
from tests._swift import REGION, aws_env, running_swift

pytest.importorskip("redis", reason="redis-py is installed by scripts/deps/00-python.sh")
pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.s3]

BLOCK = 64 * 1024
CHUNK = 16
NS = {"model": "three-nodes", "dtype": "u8", "chunk_tokens": CHUNK}
BUCKET = "kvstore-three-nodes"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from running_cluster(tmp_path_factory, "three-nodes-redis")


@pytest.fixture(scope="module")
def swift(tmp_path_factory):
    yield from running_swift(tmp_path_factory, "three-nodes-swift")


def node_config(name: str, root, cluster, swift) -> dict:
    """Node ``name``'s config: its own DRAM (2 blocks) and NVMe (2 blocks) under
    ``root/name``, then the tiers every node shares (this node's budget there: 4 blocks
    in Redis, plenty in S3)."""
    return {
        "tiers": [
            {"name": "hot", "kind": "dram", "capacity": 2 * BLOCK, "pin": False},
            {"name": "warm", "kind": "nvme", "path": str(root / name / "nvme"), "capacity": 2 * BLOCK,
             "direct_io": False, "file_bytes": "1MiB"},
            {"name": "shared", "kind": "redis", "nodes": cluster.nodes_list, "capacity": 4 * BLOCK,
             "prefix": "three", "timeout_s": 2.0, "max_attempts": 2},
            {"name": "durable", "kind": "s3", "bucket": BUCKET, "endpoint_url": swift.endpoint_url,
             "region": REGION, "addressing_style": "path", "prefix": "three", "capacity": "64MiB"},
        ],
        "server": {"host": "127.0.0.1", "port": 0, "admin_port": 0,
                   "socket_path": str(root / name / "kvstore.sock")},
    }


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, cluster, swift):
    root = tmp_path_factory.mktemp("three-nodes")
    swift.client().create_bucket(Bucket=BUCKET)
    env = aws_env(swift, root)
    started: dict[str, ProcessServer] = {}
    try:
        for name in "abc":
            (root / name).mkdir()
            started[name] = ProcessServer(node_config(name, root, cluster, swift), root / name, env=env)
        yield started
    finally:
        for server in started.values():
            server.kill()


def prompt(n_chunks: int, salt: str):
    """``(namespace fields, token ids, keys, payloads)`` of one prompt; the salt sets it apart."""
    tokens = list(range(1000, 1000 + n_chunks * CHUNK))
    ns = {**NS, "salt": salt}
    keys = Namespace(**ns).chunk_keys(tokens)
    rng = np.random.default_rng(sum(salt.encode()) * 7919)
    return (ns, tokens), keys, [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in keys]


def save_one_by_one(client: Client, keys, srcs) -> None:
    for key, src in zip(keys, srcs):   # one block per save: the spill order is the save order
        assert client.save([key], [src]).result(30) == [True]


def load(client: Client, keys) -> tuple[list[bool], list[np.ndarray]]:
    dsts = [np.zeros(BLOCK, np.uint8) for _ in keys]
    return client.load(keys, dsts).result(60), dsts


def admin(server: ProcessServer, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{server.admin_port}{path}", data=data,
                                     method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def lookup(server: ProcessServer, request, extra=()) -> tuple[int, dict[str, int]]:
    ns, tokens = request
    answer = admin(server, "/v1/lookup", {"namespace": ns, "token_ids": [*tokens, *extra]})
    return answer["prefix_blocks"], {t["name"]: t["prefix_blocks"] for t in answer["tiers"]}


def tier_stats(server: ProcessServer) -> dict[str, dict]:
    return {t["name"]: t for t in admin(server, "/stats")["tiers"]}


def test_three_nodes_share_blocks_and_survive_a_lost_node(nodes):
    a, b, c = nodes["a"], nodes["b"], nodes["c"]
    tokens, keys, srcs = prompt(6, "p")
    _, filler, filler_srcs = prompt(6, "filler-a")
    s_tokens, s_keys, s_srcs = prompt(2, "s")
    _, b_filler, b_filler_srcs = prompt(4, "filler-b")

    # Node A saves the prompt, then enough after it that the prompt leaves A's own tiers.
    with Client(a.address) as client_a:
        save_one_by_one(client_a, keys, srcs)
        save_one_by_one(client_a, filler, filler_srcs)
    held, where = lookup(a, tokens)
    assert held == 6 and where["hot"] == 0 and where["warm"] == 0, where   # evicted from A's node
    on_a = tier_stats(a)
    assert on_a["shared"]["blocks"] > 0 and on_a["durable"]["blocks"] > 0   # spilled down both shared tiers
    assert on_a["hot"]["spills"] > 0 and on_a["warm"]["spills"] > 0 and on_a["shared"]["spills"] > 0

    # Node B pushes its own prompt into the shared tiers too.
    with Client(b.address) as client_b:
        save_one_by_one(client_b, s_keys, s_srcs)
        save_one_by_one(client_b, b_filler, b_filler_srcs)
    assert lookup(b, s_tokens)[1]["warm"] == 0

    # Node C, running all along, has never seen the prompt: it finds and loads it.
    assert lookup(c, tokens)[0] == 0            # /v1/lookup reads C's index only
    with Client(c.address) as client_c:
        assert client_c.lookup(keys) == 6       # the Store asks Redis, then S3
        ok, dsts = load(client_c, keys)
    assert ok == [True] * 6
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs)), "C loaded bytes that differ from A's"
    on_c = tier_stats(c)
    assert on_c["shared"]["found"] + on_c["durable"]["found"] >= 6
    assert on_c["shared"]["hits"] + on_c["durable"]["hits"] >= 6 and on_c["hot"]["promotions"] >= 1

    # Node B is lost.
    b.proc.send_signal(9)
    assert b.proc.wait(10) == -9
    b.kill()   # closes its pipes, removes its socket and shm files

    # A and C keep serving: B's blocks from the shared tiers, new saves, both nodes.
    with Client(c.address) as client_c, Client(a.address) as client_a:
        assert client_c.lookup(s_keys) == 2
        ok, dsts = load(client_c, s_keys)
        assert ok == [True, True] and all(np.array_equal(d, s) for d, s in zip(dsts, s_srcs))
        _, r_keys, r_srcs = prompt(2, "after-b")
        assert client_a.save(r_keys, r_srcs).result(30) == [True, True]
        ok, dsts = load(client_a, r_keys)
        assert ok == [True, True] and all(np.array_equal(d, s) for d, s in zip(dsts, r_srcs))
        assert client_c.lookup(r_keys) == 0     # only in A's DRAM: not shared (yet)
        ok, dsts = load(client_a, keys)         # A's own copy of the prompt, from the shared tiers
        assert ok == [True] * 6 and all(np.array_equal(d, s) for d, s in zip(dsts, srcs))

    # /v1/lookup on C reports the prefix it now holds, per tier.
    held, where = lookup(c, tokens)
    assert held == 6, where
    assert lookup(c, tokens, range(5, 5 + CHUNK))[0] == 6   # a longer prompt: the same prefix
    assert lookup(c, s_tokens)[0] == 2
    for server in (a, c):
        with urllib.request.urlopen(f"http://127.0.0.1:{server.admin_port}/healthz", timeout=10) as reply:
            assert reply.status == 200
