"""Decoder layers of every family run back to back in C++ (``csrc/decoder``).

A decode step makes about ten op calls a layer; from Python each costs a few microseconds of
argument handling, more than a small model's norms and RoPE take. :class:`DecoderLayers` runs
the same ops, in the same order, from C++ through the dispatcher: each device runs its own
kernels, the profiler sees every op, CUDA graphs capture them, and Python is called once a step.
Its plain-PyTorch twin is :func:`fastllm.ops.reference.decoder_layers`.

The records it reads are the C++ structs themselves, each declared once as a list of fields in
``csrc/decoder/decoder_layers.h`` and bound as they are: :class:`DecoderLayer` (a layer's
weights, shape and switches), :class:`ProjectionPart` and :class:`Experts` inside it, and
:class:`DecoderStep` (where a step's tokens sit in the batch and the paged cache). Each is built
by position or keyword, checked as it is built (a ValueError or TypeError naming the field),
read through its attributes and copied with some fields changed by ``replace(**changes)``;
``fields`` names its fields in order.
"""

from __future__ import annotations

from fastllm._C import (DecoderLayer, DecoderLayers, DecoderStep, Experts, ProjectionLoRA,
                        ProjectionPart)

__all__ = ["DecoderLayer", "DecoderLayers", "DecoderStep", "Experts", "ProjectionLoRA",
           "ProjectionPart"]
