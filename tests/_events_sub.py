"""A KV-events subscriber as a router writes one against vLLM's ``ZmqEventPublisher``:
a SUB socket for live batches, a DEALER for replay requests, every payload decoded by
vLLM's own ``vllm.distributed.kv_events`` msgspec classes."""

from __future__ import annotations

import msgspec
import zmq

from vllm.distributed.kv_events import KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


def decode(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


class Subscriber:
    """Live batches from ``endpoint`` (connects; or binds with ``bind=True`` for a
    publisher that connects), replay from ``replay_endpoint``."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 bind: bool = False) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if bind:
            self.sub.bind(endpoint)
            self.endpoint = self.sub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self.sub.connect(endpoint)
            self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint

    def live(self, timeout_ms: int = 5000) -> tuple[bytes, int, KVEventBatch] | None:
        """The next live ``(topic, seq, batch)``, or ``None`` after ``timeout_ms``."""
        if not self.sub.poll(timeout_ms):
            return None
        topic, seq, payload = self.sub.recv_multipart()
        return topic, int.from_bytes(seq, "big"), decode(payload)

    def replay(self, start_seq: int, timeout_ms: int = 5000) -> list[tuple[bytes, int, KVEventBatch]]:
        """Every kept batch from ``start_seq`` on, up to the end marker."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start_seq.to_bytes(8, "big")))
            out = []
            while True:
                assert dealer.poll(timeout_ms), "no replay answer"
                _, topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    assert payload == b""
                    return out
                out.append((topic, int.from_bytes(seq, "big"), decode(payload)))
        finally:
            dealer.close(linger=0)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def flat(batches) -> list:
    """The events of ``(topic, seq, batch)`` triples, in order."""
    return [ev for _, _, batch in batches for ev in batch.events]
