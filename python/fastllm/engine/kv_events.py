"""KV-cache events: the prefix cache's changes published for routers that mirror it (prefix-aware
routing: llm-d's KV-cache manager, NVIDIA Dynamo's KV router), in vLLM's wire format.

Each engine step's changes go out as one batch on a ZMQ PUB socket: a multipart message of the
topic, the batch's sequence number (8 bytes, big-endian) and the msgpack batch ``[timestamp,
events]`` (``[timestamp, events, data_parallel_rank]`` from a data-parallel rank, as vLLM's
``KVEventBatch`` encodes it), each event a tagged array as vLLM's msgspec structs encode them:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]`` (vLLM's; this engine reports each forgotten block instead, a
  reset of the prefix cache included, since blocks that requests hold stay cached)

A data-parallel rank r publishes on its own endpoints, as vLLM's ranks do: a TCP endpoint's port
plus r (``tcp://*:5557`` -> ``tcp://*:5558`` for rank 1), an ``ipc://`` or ``inproc://`` one with
``_dp<r>`` appended (:func:`rank_endpoint`).

A replay socket (ROUTER), when configured, answers ``(identity, b"", start_sequence)`` with the
buffered batches from that sequence number on, then an empty payload with sequence -1.

Block hashes (:func:`block_hash`, ``prefix_caching_hash_algo="sha256"``) are fixed, so a router
can hash a prompt the same way: a full block's hash is the SHA-256 of its parent block's hash
(32 zero bytes for a prompt's first block), then the LoRA adapter's id (0: the base model) and
each of the block's token ids, every integer as 8 bytes little-endian. The first ``block_size``
tokens of a prompt are its first block, and so on; a partial last block is never cached.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["KVEventsConfig", "KVEventPublisher", "block_hash", "prompt_block_hashes",
           "rank_endpoint"]

logger = logging.getLogger("fastllm")

_ROOT = b"\0" * 32  # a first block's parent
_SALTED = 1 << 63  # a salted chain's root: the block manager's 2**63 | cache_salt


def block_hash(parent: bytes | None, token_ids: Sequence[int], lora_id: int = 0) -> bytes:
    """The documented hash of a full block of ``token_ids`` after the block hashed ``parent``
    (None: the prompt's first block) under LoRA adapter ``lora_id`` (0: none)."""
    return hashlib.sha256((parent or _ROOT) + struct.pack(f"<{1 + len(token_ids)}Q", lora_id,
                                                          *token_ids)).digest()


def rank_endpoint(endpoint: str, data_parallel_rank: int) -> str:
    """``endpoint`` as data-parallel rank ``data_parallel_rank`` binds or connects it (vLLM's
    ``offset_endpoint_port``): a TCP endpoint's port plus the rank, an ``ipc://`` or
    ``inproc://`` one with ``_dp<rank>`` appended; rank 0's is ``endpoint`` itself."""
    if data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    address, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"endpoint {endpoint!r} has no port to offset by data_parallel_rank="
                         f"{data_parallel_rank}: give tcp://HOST:PORT, ipc:// or inproc://")
    if int(port) + data_parallel_rank > 65535:
        raise ValueError(f"endpoint {endpoint!r}: port {port} + data_parallel_rank="
                         f"{data_parallel_rank} is past 65535")
    return f"{address}:{int(port) + data_parallel_rank}"


def prompt_block_hashes(token_ids: Sequence[int], block_size: int,
                        lora_id: int = 0) -> list[bytes]:
    """The hashes of a prompt's full blocks, first to last: what a router computes to find the
    replica that caches the longest prefix of it."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(block_hash(hashes[-1] if hashes else None,
                                 token_ids[start:start + block_size], lora_id))
    return hashes


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config``.

    Attributes:
        enable_kv_cache_events: publish the prefix cache's changes.
        publisher: "zmq", or "null" (recorded and dropped: for tests of the engine alone).
        endpoint: where the PUB socket binds (``tcp://*:5557``) or, with ``://`` and no
            ``*``, connects.
        replay_endpoint: where the replay ROUTER socket binds; None: no replay.
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's send high-water mark (messages queued per subscriber).
        topic: the first frame of every message.
        data_parallel_rank: fastllm's (``fastllm serve --data-parallel-rank``; vLLM passes it
            beside the config): the endpoints become this rank's (:func:`rank_endpoint`) and
            each batch carries it. None: a server that is no data-parallel rank.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise TypeError(f"enable_kv_cache_events must be a bool, got "
                            f"{self.enable_kv_cache_events!r}")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {self.publisher!r}")
        for name in ("buffer_steps", "hwm"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a str, got {getattr(self, name)!r}")
        rank = self.data_parallel_rank
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)
                                 or rank < 0):
            raise ValueError(f"data_parallel_rank must be None or an int >= 0, got {rank!r}")
        for endpoint in (self.endpoint, self.replay_endpoint):
            if rank is not None and endpoint is not None:
                rank_endpoint(endpoint, rank)  # a bad endpoint fails here, not in the engine

    @classmethod
    def of(cls, value: KVEventsConfig | Mapping[str, Any] | None) -> KVEventsConfig | None:
        """The config from itself, a dict of its fields (an unknown key is a ValueError naming
        it) or None."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"kv_events_config must be a dict or KVEventsConfig, got "
                            f"{type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config has no field {unknown[0]!r} (fields: "
                             f"{', '.join(sorted(known))})")
        return cls(**value)


class KVEventPublisher:
    """Turns the block manager's cache events (``BlockManager.take_cache_events``) into vLLM's
    events with :func:`block_hash` hashes and publishes them, one batch per call of
    :meth:`publish`. Keeps each cached prefix's hash until it is forgotten (as many as the
    cache holds blocks)."""

    def __init__(self, config: KVEventsConfig, block_size: int) -> None:
        self.config, self.block_size = config, block_size
        # Each cached prefix id -> its block's hash and its chain's LoRA adapter id.
        self._cached: dict[int, tuple[bytes, int]] = {}
        self._sequence = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._lock = threading.Lock()  # the replay thread reads the buffer
        self._context = self._socket = None
        replay_thread: threading.Thread | None = None
        closed = threading.Event()
        if config.publisher == "zmq":
            try:
                import msgpack  # noqa: F401  (publish's; checked before any socket opens)
                import zmq
            except ModuleNotFoundError as error:
                raise ImportError(f"KV-cache events need pyzmq and msgpack ({error.name} is "
                                  "missing): pip install 'fastllm[server]'") from None

            self._context = zmq.Context()
            self._socket = self._context.socket(zmq.PUB)
            self._socket.setsockopt(zmq.SNDHWM, config.hwm)
            self._socket.setsockopt(zmq.LINGER, 0)
            rank = config.data_parallel_rank or 0
            self._attach(self._socket, rank_endpoint(config.endpoint, rank))
            if config.replay_endpoint is not None:
                replay = self._context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(rank_endpoint(config.replay_endpoint, rank))
                # The thread owns its socket and holds the buffer, not the publisher: dropping
                # the engine closes everything (the finalizer) without a shutdown call.
                replay_thread = threading.Thread(
                    target=_serve_replays, name="kv-events-replay", daemon=True,
                    args=(replay, self._buffer, self._lock, closed))
                replay_thread.start()
        #: Closes the sockets (idempotent; also when the publisher is collected).
        self.close = weakref.finalize(self, _close, self._context, self._socket, replay_thread,
                                      closed)

    @staticmethod
    def _attach(socket: Any, endpoint: str) -> None:
        if "*" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            socket.bind(endpoint)
        else:
            socket.connect(endpoint)

    def events(self, cache_events: Sequence[tuple[bool, int, int, list[int]]]) -> list[list]:
        """vLLM's events for the block manager's ``cache_events``."""
        events: list[list] = []
        for stored, prefix_id, parent_id, token_ids in cache_events:
            if not stored:
                forgotten = self._cached.pop(prefix_id, None)
                if forgotten is not None:
                    events.append(["BlockRemoved", [forgotten[0]], None])
                continue
            if parent_id == 0 or parent_id & _SALTED:  # a first block
                parent, lora_id = None, parent_id & ~_SALTED
            elif parent_id in self._cached:
                parent, lora_id = self._cached[parent_id]
            else:  # its parent left the cache before it came: no prompt reaches it
                continue
            digest = block_hash(parent, token_ids, lora_id)
            self._cached[prefix_id] = (digest, lora_id)
            events.append(["BlockStored", [digest], parent, list(token_ids), self.block_size,
                           lora_id or None, None])
        return events

    def publish(self, cache_events: Sequence[tuple[bool, int, int, list[int]]]) -> None:
        """Publishes ``cache_events`` as one batch (nothing when there are none)."""
        events = self.events(cache_events)
        if not events:
            return
        import msgpack

        batch = [time.time(), events]
        if self.config.data_parallel_rank is not None:  # vLLM omits the field when unset
            batch.append(self.config.data_parallel_rank)
        payload = msgpack.packb(batch, use_bin_type=True)
        with self._lock:
            sequence = self._sequence
            self._sequence += 1
            self._buffer.append((sequence, payload))
        if self._socket is not None:
            self._socket.send_multipart([self.config.topic.encode(),
                                         sequence.to_bytes(8, "big", signed=True), payload])



def _serve_replays(replay: Any, buffer: deque[tuple[int, bytes]], lock: threading.Lock,
                   closed: threading.Event) -> None:
    """Answers replay requests on ``replay`` until ``closed``, then closes it: ``(identity,
    b"", start)`` gets the buffered batches from sequence ``start`` on, then sequence -1 with
    an empty payload."""
    import zmq

    poller = zmq.Poller()
    poller.register(replay, zmq.POLLIN)
    try:
        while not closed.is_set():
            if not poller.poll(100):
                continue
            try:
                identity, _, start = replay.recv_multipart()
            except ValueError:
                continue  # not (identity, b"", start): ignored
            first = int.from_bytes(start, "big", signed=True)
            with lock:
                batches = [(s, p) for s, p in buffer if s >= first]
            for sequence, payload in [*batches, (-1, b"")]:
                replay.send_multipart([identity, b"", sequence.to_bytes(8, "big", signed=True),
                                       payload])
    finally:
        replay.close(linger=0)


def _close(context: Any, socket: Any, replay_thread: threading.Thread | None,
           closed: threading.Event) -> None:
    closed.set()
    if replay_thread is not None:
        replay_thread.join(timeout=5)
    if socket is not None:
        socket.close(linger=0)
    if context is not None:
        context.term()
