"""Sampling: vLLM's ``SamplingParams`` and the batched sampling step over the sampling ops."""

from fastllm.sampling.sampler import (
    SampleOutput,
    SamplingParams,
    SamplingTensors,
    draw,
    penalize,
    resolve_seed,
    sample_next_tokens,
)

__all__ = ["SampleOutput", "SamplingParams", "SamplingTensors", "draw", "penalize",
           "resolve_seed", "sample_next_tokens"]
