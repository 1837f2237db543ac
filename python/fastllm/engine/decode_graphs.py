"""CUDA graphs of the decode step.

A decode step (one new token per sequence, logits for each) launches about ten kernels per
layer; at small batches on a GPU the launches, not the kernels, set the pace. ``DecodeGraphs``
captures the model's forward and LM head once per padded batch size and replays it, after
copying the step's inputs into the static buffer the graph reads (one device-to-device copy
queued on the stream: the host never waits).

A batch of ``B`` sequences runs in the smallest captured size ``>= B``. The padding rows are
sequences with no keys (``seq_lens`` 0) whose one token has no cache slot (``slot_mapping``
-1): they write nothing, read nothing and their rows are dropped. The block tables are as wide as
``max_model_len`` needs, so one graph serves every sequence length.

Without ``use_cuda_graphs`` (any device but CUDA) the same padded step runs eagerly: that is
how the padding is tested on machines without a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fastllm import ops
from fastllm.kv_cache import PagedKVCache
from fastllm.models import DecoderLM

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
    and live as long as this object (they hold the model's activations for that size).

    A graph's static inputs are the token ids and one :class:`fastllm.ops.DecoderStep` over
    views of one buffer. A step's inputs (its token ids and the host tensors of its
    ``DecoderStep``, as the model runner builds them for any step) arrive packed as that buffer
    holds them (:meth:`pack`, on the host, padding rows included), travel with the rest of the
    step's host data and land in the buffer in one device-to-device copy (:meth:`run`)."""

    def __init__(self, model: DecoderLM, kv_cache: PagedKVCache, *, max_batch: int,
                 max_model_len: int, use_cuda_graphs: bool | None = None) -> None:
        self.model, self.kv_cache = model, kv_cache
        self.sizes = padded_batch_sizes(max_batch)
        device = kv_cache.k_cache.device
        self.use_cuda_graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        if self.use_cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the KV cache is on {device}")
        self.width = math.ceil(max_model_len / kv_cache.spec.block_size)  # block-table columns
        # Every size's inputs, packed (_views), share this buffer: graphs never run at once.
        self.inputs = torch.zeros(self._words(self.sizes[-1]), dtype=torch.long, device=device)
        # One query per sequence, padding rows included: never changes.
        self.cu_seqlens_q = torch.arange(self.sizes[-1] + 1, dtype=torch.int32, device=device)
        self._static: dict[int, tuple[Tensor, ops.DecoderStep]] = {}  # size -> (ids, step)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = None  # the memory pool every graph shares (they never run at once)

    def supports(self, batch: int, max_blocks: int) -> bool:
        """Whether a decode step of ``batch`` sequences, whose block tables are ``max_blocks``
        wide, fits the buffers."""
        return 0 < batch <= self.sizes[-1] and max_blocks <= self.width

    def _fields(self, size: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The packed inputs at padded batch ``size``, in their order in the buffer: the token
        ids and the DecoderStep's tensors that change from step to step (int64 ones first, so
        that each starts aligned)."""
        return {"input_ids": (torch.long, (size,)), "positions": (torch.long, (size,)),
                "slot_mapping": (torch.long, (size,)), "seq_lens": (torch.int32, (size,)),
                "block_tables": (torch.int32, (size, self.width))}

    def _words(self, size: int) -> int:
        """int64 words of a step's packed inputs at padded batch ``size``."""
        nbytes = sum(math.prod(shape) * dtype.itemsize
                     for dtype, shape in self._fields(size).values())
        return -(-nbytes // 8)

    def _views(self, packed: Tensor, size: int) -> dict[str, Tensor]:
        """The inputs :meth:`_fields` lists, as views of ``packed``."""
        raw, offset, views = packed.view(torch.uint8), 0, {}
        for name, (dtype, shape) in self._fields(size).items():
            nbytes = math.prod(shape) * dtype.itemsize
            views[name] = raw[offset:offset + nbytes].view(dtype).view(shape)
            offset += nbytes
        return views

    def pack(self, input_ids: Sequence[int], step: Mapping[str, Tensor]) -> Tensor:
        """A decode step's inputs on the host, packed as :meth:`run` reads them: its token ids
        (one per sequence) and the host tensors of its DecoderStep by field
        (:func:`fastllm.engine.model_runner.step_tensors`), with the padding rows of its
        captured size: no keys, no slot, position 0."""
        batch = step["seq_lens"].shape[0]
        if len(input_ids) != batch or step["slot_mapping"].shape[0] != batch:
            raise ValueError(f"a decode step has one new token per sequence, got "
                             f"{step['slot_mapping'].shape[0]} tokens for {batch} sequences")
        block_tables = step["block_tables"]
        if not self.supports(batch, block_tables.shape[1]):
            raise ValueError(f"a decode step of {batch} sequences with block tables "
                             f"{block_tables.shape[1]} wide exceeds the captured "
                             f"{self.sizes[-1]} x {self.width}")
        size = next(s for s in self.sizes if s >= batch)
        packed = torch.zeros(self._words(size), dtype=torch.long)
        views = self._views(packed, size)
        views["input_ids"][:batch] = torch.tensor(input_ids, dtype=torch.long)
        for name in ("positions", "slot_mapping", "seq_lens"):
            views[name][:batch] = step[name]
        views["slot_mapping"][batch:] = -1
        views["block_tables"][:batch, :block_tables.shape[1]] = block_tables
        return packed

    def run(self, packed: Tensor, batch: int) -> Tensor:
        """Logits ``[batch, vocab]`` of a decode step: ``packed`` is :meth:`pack`'s result on
        the device. Valid until the next call."""
        size = next(s for s in self.sizes if s >= batch)
        if packed.shape != (self._words(size),):
            raise ValueError(f"packed inputs for {batch} sequences must be "
                             f"[{self._words(size)}], got {list(packed.shape)}")
        self.inputs[:packed.shape[0]].copy_(packed, non_blocking=True)
        if not self.use_cuda_graphs:
            return self._forward(size)[:batch]
        if size not in self._graphs:
            self._capture(size)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:batch]

    def _static_inputs(self, size: int) -> tuple[Tensor, ops.DecoderStep]:
        """The token ids and the DecoderStep a step of padded batch ``size`` reads (and its
        graph captures): views of the shared buffer, built once."""
        if size not in self._static:
            views = self._views(self.inputs, size)
            input_ids = views.pop("input_ids")
            self._static[size] = input_ids, ops.DecoderStep(
                **views, cu_seqlens_q=self.cu_seqlens_q[:size + 1], max_seqlen_q=1)
        return self._static[size]

    def _forward(self, size: int) -> Tensor:
        input_ids, step = self._static_inputs(size)
        return self.model.compute_logits(self.model(input_ids, step, self.kv_cache))

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
