"""fastllm on Ray Serve: replicas of ``fastllm serve``'s OpenAI-compatible app behind Serve's
HTTP proxy, on one machine or a Ray cluster with the same code (``pip install
'fastllm[server,ray]'``).

    from ray import serve
    from fastllm.entrypoints.ray_serve import LLMConfig, build_openai_app

    config = LLMConfig(
        model_loading_config={"model_id": "qwen3", "model_source": "Qwen/Qwen3-0.6B"},
        engine_kwargs={"dtype": "bfloat16", "max_model_len": 4096},
        deployment_config={"num_replicas": 2, "ray_actor_options": {"num_cpus": 4}})
    serve.run(build_openai_app({"llm_configs": [config]}))

or ``serve run config.yaml`` with ``import_path:
fastllm.entrypoints.ray_serve:build_openai_app`` and the same dict under ``args``.

The names are Ray Serve LLM's (``ray.serve.llm``): :class:`LLMConfig` with
``model_loading_config`` (``model_id``: the name clients send, ``model_source``: what
fastllm loads), ``engine_kwargs`` (:class:`fastllm.LLM`'s arguments, as ``fastllm serve``'s
engine options) and ``deployment_config`` (Serve's deployment options: ``num_replicas``,
``ray_actor_options``, ``autoscaling_config``...), plus fastllm's ``server_config``
(:class:`~fastllm.entrypoints.openai.api_server.ServerConfig`'s fields); one deployment
``LLMServer:<model_id>``. Unlike Ray Serve LLM, no router deployment sits in front: each
replica serves fastllm's whole app (``build_app``) through ``serve.ingress``, and Serve's proxy
picks the replica. One model (with its LoRA adapters) per application: run several
applications, on distinct route prefixes, for several models.

Each replica builds its own :class:`fastllm.AsyncLLM`, computes on as many threads as the CPUs
Ray assigned it (``ray_actor_options.num_cpus``, 1 by default), answers with an
``x-fastllm-replica`` header naming itself, fails Serve's health check once its engine thread
has failed (Serve then replaces it), and shuts its engine down when Serve stops it. A request
reaches one replica: ``/metrics`` and ``/reset_prefix_cache`` through the proxy answer for the
replica they land on, and runtime LoRA loading (which would load an adapter on one replica
only) is refused; list adapters in ``server_config["lora_modules"]`` instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray import serve
from ray.serve.deployment import Application, Deployment

from fastllm.entrypoints.async_llm import AsyncLLM
from fastllm.entrypoints.llm import LLM
from fastllm.entrypoints.openai.api_server import ServerConfig, build_app

__all__ = ["LLMConfig", "LLMServer", "LLMServingArgs", "ModelLoadingConfig",
           "build_llm_deployment", "build_openai_app"]

REPLICA_HEADER = "x-fastllm-replica"

# What fastllm.LLM takes besides the model (the tokenizer comes from tokenizer_source).
_ENGINE_KWARGS = frozenset(inspect.signature(LLM.__init__).parameters) - {"self", "model"}
# ServerConfig's fields that mean something under Serve: its proxy listens, not the replica.
_SERVER_FIELDS = frozenset(f.name for f in dataclasses.fields(ServerConfig)) - {"host", "port"}
# Serve's deployment options (Deployment.options' public parameters).
_DEPLOYMENT_OPTIONS = frozenset(
    name for name in inspect.signature(Deployment.options).parameters
    if not name.startswith("_") and name not in ("self", "func_or_class"))


def _fields_of(cls: type, value: Any, what: str) -> dict[str, Any]:
    """``value`` (a dict of ``cls``'s fields) checked for unknown keys; ``what`` names it."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a dict or {cls.__name__}, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{what} has no field {unknown[0]!r} (fields: {', '.join(sorted(known))})")
    return dict(value)


def _check_keys(value: Any, allowed: frozenset[str], what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{what} must be a dict, got {type(value).__name__}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(f"{what} has no key {unknown[0]!r} (keys: {', '.join(sorted(allowed))})")
    return dict(value)


@dataclass(frozen=True)
class ModelLoadingConfig:
    """What to load and the name it is served under (Ray Serve LLM's fields).

    Attributes:
        model_id: the model name clients send and ``/v1/models`` lists (``fastllm serve
            --served-model-name``).
        model_source: what fastllm loads: a folder, a .gguf file or a Hugging Face Hub name
            (``fastllm serve MODEL``); None: ``model_id``.
        tokenizer_source: where the tokenizer comes from (``--tokenizer``); None: the model's.
    """

    model_id: str
    model_source: str | None = None
    tokenizer_source: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"model_id must be a non-empty str, got {self.model_id!r}")
        for name in ("model_source", "tokenizer_source"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty str or None, got {value!r}")


@dataclass(frozen=True)
class LLMConfig:
    """One model's Serve deployment; every field is checked here, on the driver, so a typo fails
    at once rather than in each replica.

    Attributes:
        model_loading_config: a :class:`ModelLoadingConfig` or a dict of its fields.
        engine_kwargs: :class:`fastllm.LLM`'s arguments (``dtype``, ``max_model_len``,
            ``max_num_seqs``, ``enable_lora``, ``kv_events_config``...).
        server_config: :class:`~fastllm.entrypoints.openai.api_server.ServerConfig`'s fields
            but ``host`` and ``port`` (Serve's proxy listens): ``api_key``, ``chat_template``,
            ``tool_call_parser``, ``lora_modules``...
        deployment_config: ``serve.deployment``'s options (``num_replicas``,
            ``ray_actor_options``, ``autoscaling_config``, ``max_ongoing_requests``...);
            ``max_ongoing_requests`` defaults to what one replica admits before it answers 503
            (``max_num_seqs`` running plus ``max_waiting_requests`` queued), so Serve holds
            the rest; ``name`` defaults to ``LLMServer:<model_id>``.
    """

    model_loading_config: ModelLoadingConfig
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    server_config: dict[str, Any] = field(default_factory=dict)
    deployment_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        loading = self.model_loading_config
        if not isinstance(loading, ModelLoadingConfig):
            loading = ModelLoadingConfig(**_fields_of(ModelLoadingConfig, loading,
                                                      "model_loading_config"))
            object.__setattr__(self, "model_loading_config", loading)
        engine = _check_keys(self.engine_kwargs, _ENGINE_KWARGS, "engine_kwargs")
        if "tokenizer" in engine:
            raise ValueError("engine_kwargs' tokenizer: give it as model_loading_config's "
                             "tokenizer_source")
        server = _check_keys(self.server_config, _SERVER_FIELDS, "server_config")
        ServerConfig(**server)  # its own checks (parsers, limits), here rather than per replica
        if server.get("allow_runtime_lora_updating"):
            raise ValueError("server_config's allow_runtime_lora_updating: under Serve a load "
                             "or unload reaches one replica only; list the adapters in "
                             "server_config's lora_modules")
        if server.get("lora_modules") and not engine.get("enable_lora"):
            raise ValueError("server_config's lora_modules needs engine_kwargs' enable_lora")
        deployment = _check_keys(self.deployment_config, _DEPLOYMENT_OPTIONS, "deployment_config")
        for name, value in (("engine_kwargs", engine), ("server_config", server),
                            ("deployment_config", deployment)):
            object.__setattr__(self, name, value)

    @property
    def model_id(self) -> str:
        """The name clients send."""
        return self.model_loading_config.model_id

    @classmethod
    def of(cls, value: LLMConfig | Mapping[str, Any]) -> LLMConfig:
        """The config from itself or a dict of its fields (an unknown key is a ValueError)."""
        if isinstance(value, LLMConfig):
            return value
        return cls(**_fields_of(cls, value, "an llm_configs entry"))

    def deployment_options(self) -> dict[str, Any]:
        """``serve.deployment``'s options: ``deployment_config`` over fastllm's defaults."""
        max_num_seqs = self.engine_kwargs.get(
            "max_num_seqs", inspect.signature(LLM.__init__).parameters["max_num_seqs"].default)
        max_waiting = self.server_config.get("max_waiting_requests",
                                             ServerConfig.max_waiting_requests)
        defaults = {"name": "LLMServer:" + self.model_id.replace("/", "--").replace(".", "_"),
                    "max_ongoing_requests": max_num_seqs + max_waiting}
        return {**defaults, **self.deployment_config}


@dataclass(frozen=True)
class LLMServingArgs:
    """:func:`build_openai_app`'s argument (Ray Serve LLM's name).

    Attributes:
        llm_configs: exactly one :class:`LLMConfig` (or dict of its fields): fastllm's app
            serves one model per application.
    """

    llm_configs: list[LLMConfig]

    def __post_init__(self) -> None:
        configs = self.llm_configs
        if isinstance(configs, (str, bytes, Mapping)) or not isinstance(configs, (list, tuple)):
            raise TypeError(f"llm_configs must be a list of LLMConfig or dicts, got "
                            f"{type(configs).__name__}")
        if len(configs) != 1:
            raise ValueError(f"llm_configs must hold exactly one model, got {len(configs)}: "
                             "fastllm serves one model (and its LoRA adapters) per application; "
                             "run one application per model, on distinct route prefixes")
        object.__setattr__(self, "llm_configs", [LLMConfig.of(configs[0])])


class _ReplicaHeader:
    """Pure ASGI middleware: names the replica in every response's ``x-fastllm-replica``."""

    def __init__(self, app: Any, replica: str) -> None:
        self.app, self.header = app, (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named_send)


def _assigned_cpus() -> int:
    """The CPUs Ray assigned this replica, at least 1 (a fractional share gets 1 thread)."""
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
    return max(1, math.floor(cpus))


@serve.ingress()
class LLMServer:
    """One replica: an :class:`~fastllm.AsyncLLM` and fastllm's FastAPI app over it."""

    async def __init__(self, llm_config: LLMConfig) -> None:
        self.llm_config = llm_config
        # The CPUs Ray gave this replica, whatever OMP_NUM_THREADS its worker inherited.
        torch.set_num_threads(_assigned_cpus())
        loading = llm_config.model_loading_config
        # Loading takes a while: off the replica's event loop, which answers Serve meanwhile.
        self.llm = await asyncio.to_thread(
            AsyncLLM, loading.model_source or loading.model_id,
            tokenizer=loading.tokenizer_source, **llm_config.engine_kwargs)

    def __serve_build_asgi_app__(self) -> Any:
        """The app Serve mounts (``serve.ingress``'s late-bound form: built after the engine)."""
        app = build_app(self.llm, ServerConfig(**self.llm_config.server_config),
                        self.llm_config.model_id)
        replica = serve.get_replica_context().replica_id.unique_id
        app.add_middleware(_ReplicaHeader, replica=replica)  # still a FastAPI app for Serve
        return app

    async def check_health(self) -> None:
        """Serve's health check: fails once the engine thread has failed."""
        if self.llm.failed:
            raise RuntimeError("the fastllm engine thread failed")

    def __del__(self) -> None:
        # Serve calls it when it stops the replica; a replica whose engine never started has
        # nothing to stop.
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.shutdown()


def build_llm_deployment(llm_config: LLMConfig | Mapping[str, Any]) -> Application:
    """The Serve application of one :class:`LLMConfig` (a dict of its fields too): its
    deployment, bound, for ``serve.run``."""
    config = LLMConfig.of(llm_config)
    return serve.deployment(LLMServer, **config.deployment_options()).bind(config)


def build_openai_app(llm_serving_args: LLMServingArgs | Mapping[str, Any]) -> Application:
    """The OpenAI-compatible Serve application of :class:`LLMServingArgs` (or a dict
    ``{"llm_configs": [...]}``, as ``serve run``'s ``args`` give it): what ``serve run
    fastllm.entrypoints.ray_serve:build_openai_app`` and ``serve.run`` deploy."""
    if not isinstance(llm_serving_args, LLMServingArgs):
        llm_serving_args = LLMServingArgs(**_fields_of(LLMServingArgs, llm_serving_args,
                                                       "llm_serving_args"))
    return build_llm_deployment(llm_serving_args.llm_configs[0])
