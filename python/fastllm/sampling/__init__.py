"""Sampling: vLLM's ``SamplingParams`` and the batched sampling step over the sampling ops."""

from fastllm.sampling.sampler import (
    SampleOutput,
    SamplingParams,
    SamplingTensors,
    StructuredOutputsParams,
    draw,
    mask_tokens,
    penalize,
    resolve_seed,
    sample_next_tokens,
)

__all__ = ["SampleOutput", "SamplingParams", "SamplingTensors", "StructuredOutputsParams",
           "draw", "mask_tokens", "penalize", "resolve_seed", "sample_next_tokens"]
