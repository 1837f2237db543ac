"""CUDA graphs of the decode step.

A decode step (one new token per sequence, logits for each) launches about ten kernels per
layer; at small batches on a GPU the launches, not the kernels, set the pace. ``DecodeGraphs``
captures the model's forward and LM head once per padded batch size and replays it, after
copying the step's inputs into the static buffers the graph reads (device-to-device copies
queued on the stream: the host never waits).

A batch of ``B`` sequences runs in the smallest captured size ``>= B``. The padding rows are
sequences with no keys (``seq_lens`` 0) whose one token has no cache slot (``slot_mapping``
-1): they write nothing, read nothing and their rows are dropped. The block-table buffer is as
wide as ``max_model_len`` needs, so one graph serves every sequence length.

Without ``use_cuda_graphs`` (any device but CUDA) the same padded step runs eagerly: that is
how the padding is tested on machines without a GPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fastllm.kv_cache import PagedKVCache
from fastllm.models import AttentionMetadata, DecoderLM

__all__ = ["DecodeGraphs", "padded_batch_sizes"]


def padded_batch_sizes(max_batch: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then multiples of 16, then
    ``max_batch`` (vLLM's ladder): at most 15 padding rows past 16."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [size for size in (1, 2, 4, 8) if size < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    """Decode steps of ``model`` over ``kv_cache`` through CUDA graphs, up to ``max_batch``
    sequences of up to ``max_model_len`` tokens. Graphs are captured on first use of a size
    and live as long as this object (they hold the model's activations for that size)."""

    def __init__(self, model: DecoderLM, kv_cache: PagedKVCache, *, max_batch: int,
                 max_model_len: int, use_cuda_graphs: bool | None = None) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.sizes = padded_batch_sizes(max_batch)
        device = kv_cache.k_cache.device
        self.use_cuda_graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        if self.use_cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {device}")
        rows = self.sizes[-1]
        width = math.ceil(max_model_len / kv_cache.spec.block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(rows, width, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        # One query per sequence, padding rows included: never changes.
        self.cu_seqlens_q = torch.arange(rows + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = None  # the memory pool every graph shares (they never run at once)

    def supports(self, batch: int, max_blocks: int) -> bool:
        """Whether a decode step of ``batch`` sequences, whose block tables are ``max_blocks``
        wide, fits the buffers."""
        return 0 < batch <= self.sizes[-1] and max_blocks <= self.block_tables.shape[1]

    def run(self, input_ids: Tensor, meta: AttentionMetadata) -> Tensor:
        """Logits ``[B, vocab]`` of a decode step: ``input_ids`` ``[B]`` and the step's
        metadata (one new token per sequence). Valid until the next call."""
        batch = input_ids.shape[0]
        if meta.max_seqlen_q != 1 or meta.slot_mapping.shape[0] != batch:
            raise ValueError(f"a decode step has one new token per sequence, got "
                             f"{meta.slot_mapping.shape[0]} tokens for {batch} sequences")
        if not self.supports(batch, meta.block_tables.shape[1]):
            raise ValueError(f"a decode step of {batch} sequences with block tables "
                             f"{meta.block_tables.shape[1]} wide exceeds the captured "
                             f"{self.sizes[-1]} x {self.block_tables.shape[1]}")
        size = next(s for s in self.sizes if s >= batch)
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(meta.positions, non_blocking=True)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping, non_blocking=True)
        self.block_tables[:batch, :meta.block_tables.shape[1]].copy_(meta.block_tables,
                                                                    non_blocking=True)
        # Padding rows: no keys, no slot, position 0 (columns past a row's length are never
        # read, so stale block ids there are harmless).
        self.positions[batch:size].zero_()
        self.seq_lens[batch:size].zero_()
        self.slot_mapping[batch:size].fill_(-1)
        if not self.use_cuda_graphs:
            return self._forward(size)[:batch]
        if size not in self._graphs:
            self._capture(size)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:batch]

    def _forward(self, size: int) -> Tensor:
        meta = AttentionMetadata(cu_seqlens_q=self.cu_seqlens_q[:size + 1], max_seqlen_q=1,
                                 seq_lens=self.seq_lens[:size],
                                 block_tables=self.block_tables[:size],
                                 slot_mapping=self.slot_mapping[:size],
                                 positions=self.positions[:size])
        hidden = self.model(self.input_ids[:size], meta.positions, meta, self.kv_cache)
        return self.model.compute_logits(hidden)

    def _capture(self, size: int) -> None:
        # Warm-up on a side stream first (torch's recipe: lazy initializations such as cuBLAS
        # workspaces must not happen inside the capture). It runs the real step: the K/V it
        # writes are the ones the replay writes again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(size)
        self._pool = graph.pool()
        self._graphs[size] = (graph, logits)
