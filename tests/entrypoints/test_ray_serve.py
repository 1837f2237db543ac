"""fastllm on Ray Serve (``fastllm.entrypoints.ray_serve``): a local Ray of 2 CPUs, Serve's HTTP
proxy on a free port, 2 replicas of a tiny random Qwen3 (one CPU thread each) built from the
dict ``serve run``'s ``args`` give. The real ``openai`` client's greedy completions and chat
equal fastllm's own :class:`~fastllm.LLM` on the same folder (batch-invariant, so whatever else
a replica runs), both replicas answer (the ``x-fastllm-replica`` header), and a bad config is
refused on the driver, naming the value. Every wait is bounded."""

from __future__ import annotations

import asyncio
import gc
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from conftest import free_port, http, missing, num_threads

import fastllm
from fastllm import LLM, SamplingParams

APP = "fastllm"
MODEL = "tiny-qwen3"
ENGINE_KWARGS = {"max_model_len": 256, "batch_invariant": True}
DEPLOY_SECONDS = 120  # two replicas loading a 10M-parameter model on 2 shared cores
PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,", "def main():"]
MESSAGES = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def ray_serve():
    """fastllm.entrypoints.ray_serve, imported (with Ray) by the first test that asks for it:
    Ray takes a second to import, and a pytest-xdist worker that runs none of these never does."""
    try:
        with warnings.catch_warnings():  # Ray's own pydantic models use deprecated Field extras
            warnings.simplefilter("ignore", DeprecationWarning)
            from fastllm.entrypoints import ray_serve
    except ImportError:  # CI installs it (requirements.txt): there a missing ray fails
        missing("ray[serve] is not installed: pip install -r requirements.txt")
    return ray_serve


def wait_running(name: str, seconds: float) -> None:
    """Until Serve reports application ``name`` RUNNING; fails on DEPLOY_FAILED or after
    ``seconds``, with Serve's message."""
    from ray import serve

    deadline = time.monotonic() + seconds
    while True:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            pytest.fail(f"the Serve application failed to deploy: {status.message}")
        if time.monotonic() > deadline:
            pytest.fail(f"the Serve application is not running after {seconds} s: {status}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def base_url(ray_serve, tiny_qwen3):
    """Serve's proxy in front of 2 replicas of ``tiny_qwen3``; Ray shut down at the end."""
    import ray
    from ray import serve

    port = free_port()
    # The replicas import fastllm from where this process does (a checkout on PYTHONPATH).
    package_root = str(Path(fastllm.__file__).resolve().parents[1])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": package_root}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = ray_serve.build_openai_app({"llm_configs": [{
            "model_loading_config": {"model_id": MODEL, "model_source": str(tiny_qwen3)},
            "engine_kwargs": ENGINE_KWARGS,
            "deployment_config": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}}}]})
        serve.run_many([serve.RunTarget(app, name=APP, route_prefix="/")],
                       wait_for_ingress_deployment_creation=False,
                       wait_for_applications_running=False)
        wait_running(APP, DEPLOY_SECONDS)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_qwen3) -> LLM:
    return LLM(tiny_qwen3, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def test_completions_and_chat_equal_fastllms_own(client, reference):
    with num_threads(1):  # as each replica computes
        want = [out.outputs[0].text for out in reference.generate(PROMPTS, greedy(12),
                                                                   use_tqdm=False)]
        want_chat = reference.chat(MESSAGES, greedy(10), use_tqdm=False)[0].outputs[0].text
    got = client.completions.create(model=MODEL, prompt=PROMPTS, temperature=0, max_tokens=12)
    assert [choice.text for choice in sorted(got.choices, key=lambda c: c.index)] == want
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0,
                                          max_tokens=10)
    assert chat.choices[0].message.content == want_chat
    assert chat.model == MODEL
    assert [card.id for card in client.models.list().data] == [MODEL]


def test_both_replicas_serve(base_url, reference):
    with num_threads(1):
        want = reference.generate(PROMPTS[0], greedy(8), use_tqdm=False)[0].outputs[0].text

    def complete(_: int) -> tuple[str, str]:
        response = http.post(base_url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPTS[0], "temperature": 0, "max_tokens": 8})
        response.raise_for_status()
        return response.headers["x-fastllm-replica"], response.json()["choices"][0]["text"]

    replicas: set[str] = set()
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(4) as pool:
        # Serve's router picks the less busy of two replicas: concurrent calls reach both.
        while len(replicas) < 2 and time.monotonic() < deadline:
            for replica, text in pool.map(complete, range(8)):
                assert text == want
                replicas.add(replica)
    assert len(replicas) == 2, replicas


def test_bad_configs_are_refused_on_the_driver(ray_serve):
    loading = {"model_id": MODEL}
    with pytest.raises(ValueError, match="engine_kwargs has no key 'max_len'"):
        ray_serve.LLMConfig(loading, engine_kwargs={"max_len": 8})
    with pytest.raises(ValueError, match="server_config has no key 'port'"):
        ray_serve.LLMConfig(loading, server_config={"port": 9000})
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ray_serve.LLMConfig(loading, server_config={"tool_call_parser": "nope"})
    with pytest.raises(ValueError, match="reaches one replica only"):
        ray_serve.LLMConfig(loading, engine_kwargs={"enable_lora": True},
                            server_config={"allow_runtime_lora_updating": True})
    with pytest.raises(ValueError, match="needs engine_kwargs' enable_lora"):
        ray_serve.LLMConfig(loading, server_config={"lora_modules": {"a": "/adapter"}})
    with pytest.raises(ValueError, match="deployment_config has no key 'replicas'"):
        ray_serve.LLMConfig(loading, deployment_config={"replicas": 2})
    with pytest.raises(ValueError, match="model_loading_config has no field 'model'"):
        ray_serve.LLMConfig({"model": "x"})
    with pytest.raises(ValueError, match="model_id must be a non-empty str"):
        ray_serve.LLMConfig({"model_id": ""})
    with pytest.raises(ValueError, match="exactly one model, got 2"):
        ray_serve.build_openai_app({"llm_configs": [{"model_loading_config": loading}] * 2})
    with pytest.raises(TypeError, match="llm_configs must be a list"):
        ray_serve.build_openai_app({"llm_configs": {"model_loading_config": loading}})
    with pytest.raises(ValueError, match="llm_serving_args has no field 'llm_config'"):
        ray_serve.build_openai_app({"llm_config": {"model_loading_config": loading}})


def test_deployment_options_follow_ray_serve_llm(ray_serve):
    config = ray_serve.LLMConfig({"model_id": "Qwen/Qwen3-0.6B"},
                                 engine_kwargs={"max_num_seqs": 8},
                                 server_config={"max_waiting_requests": 24},
                                 deployment_config={"num_replicas": 3})
    assert config.deployment_options() == {"name": "LLMServer:Qwen--Qwen3-0_6B",
                                           "max_ongoing_requests": 32, "num_replicas": 3}
    options = ray_serve.LLMConfig({"model_id": "m"}, deployment_config={
        "name": "mine", "max_ongoing_requests": 4}).deployment_options()
    assert options == {"name": "mine", "max_ongoing_requests": 4}


def test_a_stopped_replica_shuts_its_engine_down_and_a_failed_one_fails_health(ray_serve):
    # Serve stops a replica by awaiting its __del__ (the ingress wrapper's, which calls ours);
    # an engine stand-in records the call.
    replica = ray_serve.LLMServer.__new__(ray_serve.LLMServer)
    stopped: list[bool] = []
    replica.llm = SimpleNamespace(failed=False, shutdown=lambda: stopped.append(True))
    asyncio.run(replica.check_health())
    replica.llm.failed = True
    with pytest.raises(RuntimeError, match="engine thread failed"):
        asyncio.run(replica.check_health())
    asyncio.run(replica.__del__())
    asyncio.run(replica.__del__())  # again: nothing left to stop
    assert stopped == [True]
    with warnings.catch_warnings():  # the wrapper's async __del__, as the collector calls it
        warnings.simplefilter("ignore", RuntimeWarning)
        del replica
        gc.collect()  # now: pytest.raises' traceback held it in a cycle
