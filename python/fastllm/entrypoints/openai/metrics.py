"""The server's Prometheus metrics (``GET /metrics``), in a registry of its own per server.

Counters and histograms are observed as requests finish; the engine's state (requests running
and waiting, KV usage, prefix-cache counters, LoRA adapters) is read when the endpoint is
scraped. The gauges a multi-replica router reads come under vLLM's names too
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
``vllm:lora_requests_info``). A data-parallel rank's server labels every sample with
``engine="<rank>"``, vLLM's label for its data-parallel engines, so that the ranks' metrics merge
into one exposition (:mod:`fastllm.entrypoints.openai.data_parallel`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fastllm.engine import Engine
from fastllm.engine.outputs import RequestOutput

__all__ = ["ServerMetrics"]

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineCollector(Collector):
    """The engine's live state, read at scrape time; ``rank_labels``: the data-parallel rank's
    label, or none."""

    def __init__(self, engine: Engine, model_name: str, rank_labels: dict[str, str]) -> None:
        self.engine, self.model_name, self.rank_labels = engine, model_name, rank_labels

    def collect(self) -> Iterator:
        labels = ["model_name", *self.rank_labels]
        values = [self.model_name, *self.rank_labels.values()]
        router_gauges = (
            ("num_requests_running", "Requests holding KV blocks.", self.engine.num_running),
            ("num_requests_waiting", "Requests queued for the engine.", self.engine.num_waiting),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks held (0 to 1).",
             self.engine.kv_usage))
        # Each also under vLLM's name, which the routers' endpoint pickers (the Gateway API
        # Inference Extension's model-server protocol: llm-d, KServe) read.
        for prefix in ("fastllm_", "vllm:"):
            for name, doc, value in router_gauges:
                gauge = GaugeMetricFamily(prefix + name, doc, labels=labels)
                gauge.add_metric(values, value)
                yield gauge
        gauge = GaugeMetricFamily(
            "fastllm_prefix_cache_hit_rate", "Prompt blocks found in the prefix cache, over "
            "those looked up, since start.", labels=labels)
        gauge.add_metric(values, self.engine.stats.prefix_cache_hit_rate)
        yield gauge
        lora = self.engine.config.lora
        if lora is not None:  # the labels carry the state, as in vLLM's
            running, waiting = self.engine.lora_adapters()
            for name in ("fastllm_lora_requests_info", "vllm:lora_requests_info"):
                info = GaugeMetricFamily(
                    name, "LoRA adapters of running and waiting requests.",
                    labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters",
                            *self.rank_labels])
                info.add_metric([str(lora.max_loras), ",".join(running), ",".join(waiting),
                                 *self.rank_labels.values()], time.time())
                yield info
        for name, doc, value in (
                ("fastllm_prefix_cache_queries", "Prompt blocks looked up in the prefix cache.",
                 self.engine.stats.prefix_cache_queries),
                ("fastllm_prefix_cache_hits", "Prompt blocks found in the prefix cache.",
                 self.engine.stats.prefix_cache_hits),
                ("fastllm_num_preemptions", "Requests preempted for KV blocks.",
                 self.engine.stats.preemptions)):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(values, value)
            yield counter


class ServerMetrics:
    """Request counts, token counts and latency histograms of one server; with
    ``data_parallel_rank``, each sample labelled ``engine="<rank>"``."""

    def __init__(self, engine: Engine, model_name: str,
                 data_parallel_rank: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._rank = {} if data_parallel_rank is None else {"engine": str(data_parallel_rank)}
        self._model = {"model_name": model_name, **self._rank}  # a request sample's labels
        labels = list(self._model)
        self.requests = Counter("fastllm_request_success", "Finished requests (one per choice).",
                                labels + ["finished_reason"], registry=self.registry)
        self.http_requests = Counter("fastllm_http_requests", "HTTP requests by status code.",
                                     ["endpoint", "status_code", *self._rank],
                                     registry=self.registry)
        self.prompt_tokens = Counter("fastllm_prompt_tokens", "Prompt tokens of finished "
                                     "requests.", labels, registry=self.registry)
        self.generation_tokens = Counter("fastllm_generation_tokens", "Generated tokens.",
                                         labels, registry=self.registry)
        self.ttft = Histogram("fastllm_time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("fastllm_time_per_output_token_seconds",
                              "Mean time between a request's output tokens.", labels,
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("fastllm_e2e_request_latency_seconds", "Arrival to finish.",
                             labels, buckets=_E2E_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine, model_name, self._rank))

    def observe(self, output: RequestOutput) -> None:
        """Counts one finished request."""
        metrics, labels = output.metrics, self._model
        self.requests.labels(**labels, finished_reason=output.outputs[0].finish_reason).inc()
        self.prompt_tokens.labels(**labels).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(**labels).inc(len(output.outputs[0].token_ids))
        if metrics.ttft is not None:
            self.ttft.labels(**labels).observe(metrics.ttft)
        if metrics.time_per_output_token is not None:
            self.tpot.labels(**labels).observe(metrics.time_per_output_token)
        if metrics.finished_time is not None:
            self.e2e.labels(**labels).observe(metrics.finished_time - metrics.arrival_time)

    def aborted(self, count: int = 1) -> None:
        """Counts requests ended early (the client left, or another choice failed)."""
        self.requests.labels(**self._model, finished_reason="abort").inc(count)

    def http_request(self, endpoint: str, status_code: int) -> None:
        """Counts one HTTP request by its endpoint and status code."""
        self.http_requests.labels(endpoint=endpoint, status_code=str(status_code),
                                  **self._rank).inc()

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)
