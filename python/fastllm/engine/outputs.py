"""What generation returns, in vLLM's shapes: a :class:`RequestOutput` per prompt holding one
:class:`CompletionOutput`, with per-token :class:`Logprob` entries and :class:`RequestMetrics`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]


@dataclass
class Logprob:
    """One token's log-probability at one position.

    Attributes:
        logprob: under the distribution the token was drawn from (see
            :func:`fastllm.ops.sample_with_logprobs`: the filtered, temperature-scaled one, or
            ``log_softmax(logits)`` for greedy requests).
        rank: 1 for the most likely token; None for a sampled token outside the reported top
            alternatives (its exact rank is not computed).
        decoded_token: the token's text on its own (special tokens included).
    """

    logprob: float
    rank: int | None
    decoded_token: str


@dataclass
class CompletionOutput:
    """One generated continuation.

    Attributes:
        index: its index among the request's completions (always 0: one per request).
        text: the generated text; a stop string that ended it, and the text of an EOS or stop
            token, are not in it.
        token_ids: every generated token, the EOS or stop token that ended it included.
        cumulative_logprob: sum of the sampled tokens' log-probabilities, when
            ``SamplingParams.logprobs`` is set.
        logprobs: per generated token, the sampled token and the ``logprobs`` most likely ones.
        finish_reason: "stop" (EOS, a stop token or a stop string), "length" (``max_tokens`` or
            the model's context), "abort" (cancelled), "error" (the request failed in a step:
            see :attr:`RequestOutput.error`) or None while running.
        stop_reason: the stop string or stop token id that ended it (None for EOS or length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


def spec_acceptance_rate(num_accepted: int, num_drafted: int) -> float | None:
    """Accepted drafts over drafted ones, None before any draft."""
    return num_accepted / num_drafted if num_drafted else None


def spec_mean_accepted_length(num_accepted: int, num_steps: int) -> float | None:
    """Tokens per verification step (accepted drafts plus the step's own), None before any."""
    return 1 + num_accepted / num_steps if num_steps else None


@dataclass
class RequestMetrics:
    """Timestamps (``time.perf_counter()`` seconds) and counts of one request.

    ``first_scheduled_time`` is when its prefill started, ``first_token_time`` when its first
    token was sampled, ``last_token_time`` its latest token, ``finished_time`` its end.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    num_generated_tokens: int = 0
    num_preemptions: int = 0  # times its KV was freed under memory pressure and recomputed
    kv_usage: float | None = None  # fraction of the KV pool in use when it finished
    # Speculative decoding: drafted tokens verified, those accepted, verification steps.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts over drafted ones (None before any draft)."""
        return spec_acceptance_rate(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification step gave on average: the accepted drafts plus the step's
        own token (vLLM's mean acceptance length; None before any verification)."""
        return spec_mean_accepted_length(self.num_accepted_tokens, self.num_verify_steps)

    @property
    def queue_time(self) -> float | None:
        """Arrival to the start of prefill."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival to the first sampled token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between consecutive output tokens (None with fewer than two)."""
        if self.num_generated_tokens < 2 or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class RequestOutput:
    """A request's prompt and its completion so far (final once ``finished``).

    ``error`` is why the request failed (finish_reason "error"), or None: a request that fails
    inside an engine step (e.g. logits its penalties overflowed) ends alone with its error,
    keeping the text it had; the other requests go on.

    ``prompt_logprobs`` (with ``SamplingParams.prompt_logprobs``, as vLLM): per prompt token,
    its logprob given the tokens before it and the most likely alternatives; None for the
    first token, which nothing precedes.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False)
    error: Exception | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingRequestOutput``, its ``outputs.embedding``
    here directly): the prompt's final hidden states pooled and L2-normalized, float32."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
