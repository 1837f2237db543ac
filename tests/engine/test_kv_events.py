"""KV-cache events for routers: a pyzmq subscriber receives vLLM's batches (topic, sequence
number, msgpack ``[ts, events]``), ``BlockStored`` with the block hashes a router computes from
the prompt by the documented algorithm (a LoRA adapter's blocks hashed apart), ``BlockRemoved``
once those blocks are evicted or the prefix cache is reset, and the replay socket resends the
batches from a sequence number on."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from conftest import free_port

from fastllm import LLM, SamplingParams
from fastllm.engine.kv_events import KVEventsConfig, block_hash, prompt_block_hashes

BLOCK = 16
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture
def endpoints():
    return free_port(), free_port()


@pytest.fixture
def subscriber(endpoints):
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{endpoints[0]}")
    yield sub
    sub.close(linger=0)
    context.term()


def received(sub, count: int) -> list[tuple[int, list]]:
    """The next ``count`` batches: (sequence number, events)."""
    batches = []
    for _ in range(count):
        topic, sequence, payload = sub.recv_multipart()
        assert topic == b"kv"
        ts, events = msgpack.unpackb(payload)
        assert abs(ts - time.time()) < 60
        batches.append((int.from_bytes(sequence, "big", signed=True), events))
    return batches


def test_stored_and_removed_blocks_carry_the_documented_hashes(model_path, endpoints,
                                                               subscriber):
    pub, replay = endpoints
    # One sequence of 128 tokens fills the pool: a long prompt evicts what the first cached.
    llm = LLM(model_path("stories260K_hf"), max_model_len=128, max_num_seqs=1,
              block_size=BLOCK, kv_events_config={
                  "enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
                  "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"})
    time.sleep(0.5)  # the subscription reaches the publisher (ZMQ's slow joiner)
    first = [1, *range(300, 339)]  # 40 tokens: two full blocks
    llm.generate(first, ONE_TOKEN, use_tqdm=False)
    (sequence, events), = received(subscriber, 1)
    hashes = prompt_block_hashes(first, BLOCK)
    assert events == [["BlockStored", [hashes[0]], None, first[:16], BLOCK, None, None],
                      ["BlockStored", [hashes[1]], hashes[0], first[16:32], BLOCK, None, None]]
    assert hashes[1] == block_hash(hashes[0], first[16:32])

    long = [1, *range(100, 219)]  # 120 tokens: all eight blocks, the first prompt's evicted
    llm.generate(long, ONE_TOKEN, use_tqdm=False)
    events = [event for _, batch in received(subscriber, 1) for event in batch]
    removed = [event[1][0] for event in events if event[0] == "BlockRemoved"]
    stored = [event[1][0] for event in events if event[0] == "BlockStored"]
    assert sorted(removed) == sorted(hashes)
    assert stored == prompt_block_hashes(long, BLOCK)[:len(stored)] and len(stored) == 7

    assert llm.engine.reset_prefix_cache() == 7
    (_, events), = received(subscriber, 1)
    assert sorted(event[1][0] for event in events) == sorted(stored)
    assert {event[0] for event in events} == {"BlockRemoved"}

    # The replay socket resends the batches from a sequence number on, then sequence -1.
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    dealer.send_multipart([b"", (sequence + 1).to_bytes(8, "big", signed=True)])
    replayed = []
    while True:
        _, number, payload = dealer.recv_multipart()
        number = int.from_bytes(number, "big", signed=True)
        if number == -1:
            break
        replayed.append(number)
        assert msgpack.unpackb(payload)[1]
    assert replayed == [sequence + 1, sequence + 2]
    dealer.close(linger=0)
    context.term()
    llm.engine.shutdown()


def test_lora_blocks_hash_apart():
    """A chain under an adapter hashes with its id (the block manager's salted root)."""
    from fastllm.engine.kv_events import KVEventPublisher

    publisher = KVEventPublisher(KVEventsConfig(True, publisher="null"), 2)
    salted = (1 << 63) | 5
    events = publisher.events([(True, 7, salted, [3, 4]), (True, 8, 7, [5, 6]),
                               (False, 7, 0, [])])
    first = block_hash(None, [3, 4], lora_id=5)
    assert events == [["BlockStored", [first], None, [3, 4], 2, 5, None],
                      ["BlockStored", [block_hash(first, [5, 6], 5)], first, [5, 6], 2, 5, None],
                      ["BlockRemoved", [first], None]]
    assert first != block_hash(None, [3, 4])
    publisher.close()


@pytest.mark.parametrize("config, error, match", [
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, ValueError, "publisher"),
    ({"enable_kv_cache_events": "yes"}, TypeError, "enable_kv_cache_events"),
    ({"enable_kv_cache_events": True, "buffer_steps": 0}, ValueError, "buffer_steps"),
    ({"enable_kv_cache_event": True}, ValueError, "no field 'enable_kv_cache_event'"),
    ("on", TypeError, "kv_events_config must be a dict"),
])
def test_bad_configs_name_the_field(model_path, config, error, match):
    with pytest.raises(error, match=match):
        LLM(model_path("stories260K_hf"), max_model_len=64, kv_events_config=config)


def test_events_need_the_prefix_cache(model_path):
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        LLM(model_path("stories260K_hf"), max_model_len=64, enable_prefix_caching=False,
            kv_events_config={"enable_kv_cache_events": True, "publisher": "null"})


def test_serve_refuses_a_config_that_is_not_json(capsys):
    from fastllm.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["serve", "unused-model", "--kv-events-config", "{enable"])
    assert exit.value.code == 2 and "not valid JSON" in capsys.readouterr().err
