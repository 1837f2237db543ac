"""The fastllm ops: typed, documented wrappers of ``torch.ops.fastllm.*``.

Every op is declared once in C++ (``csrc/ops.cpp``) and implemented per device (a native CPU
kernel; an ATen composite for MPS, which ``torch.ops.fastllm_composite.*`` runs on any device).
Input checks live in C++, in one place shared by every
device, so the wrappers, direct ``torch.ops.fastllm`` callers and ``torch.compile`` graphs all get
the same ``ValueError``/``TypeError`` naming the offending value. Each op has a fake kernel here
for ``torch.compile(fullgraph=True)`` and a plain-PyTorch twin in :mod:`fastllm.ops.reference`.

:class:`DecoderLayers` (:mod:`fastllm.ops.decoder_layers`) runs whole decoder layers of these
ops from C++, one Python call a step; :func:`all_reduce` and :func:`all_gather`
(:mod:`fastllm.ops.collectives`) join a tensor-parallel model's shards.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from fastllm import _C
from fastllm.ops.collectives import all_gather, all_reduce
from fastllm.ops.decoder_layers import (DecoderLayers, DecoderLayerWeights, ExpertWeights,
                                       ProjectionPart)

__all__ = ["BLOCK_FORMATS", "DecoderLayerWeights", "DecoderLayers", "ExpertWeights",
           "INTERLEAVED_Q4_0", "INTERLEAVED_Q4_1", "INTERLEAVED_Q4_K", "INTERLEAVED_Q5_0",
           "INTERLEAVED_Q6_K", "INTERLEAVED_Q8_0", "INTERLEAVED_TYPES", "ProjectionPart",
           "add_rms_norm", "all_gather", "all_reduce", "apply_penalties", "attention",
           "batch_invariant", "block_format", "cpu_decode_layout", "dequantize", "gelu_tanh_and_mul", "linear", "moe",
           "paged_attention", "quantized_linear", "quantized_rows", "reshape_and_cache", "rms_norm",
           "rope_cos_sin_cache", "rotary_and_cache", "rotary_embedding", "sample",
           "sample_with_logprobs",
           "silu_and_mul", "trusted_inputs"]

# The ggml block formats the quantized ops take (csrc/quantized/block_formats.h): type id ->
# (name, values per block, bytes per block). A K-quant's block is a super-block of 256 values.
BLOCK_FORMATS = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
                 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
                 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
# fastllm's own weight types, never in a file: Q4_0's, Q4_1's, Q5_0's, Q8_0's, Q4_K's and Q6_K's
# blocks with each group of 16 rows interleaved, the layout of the CPU's AVX-512 decode kernels
# (:func:`cpu_decode_layout`): ``INTERLEAVED_TYPES +`` the ggml type. The CPU ops take them;
# other devices take the ggml blocks.
INTERLEAVED_TYPES = 1000
(INTERLEAVED_Q4_0, INTERLEAVED_Q4_1, INTERLEAVED_Q5_0, INTERLEAVED_Q8_0, INTERLEAVED_Q4_K,
 INTERLEAVED_Q6_K) = (INTERLEAVED_TYPES + t for t in (2, 3, 6, 8, 12, 14))
_INTERLEAVED = (INTERLEAVED_Q4_0, INTERLEAVED_Q4_1, INTERLEAVED_Q5_0, INTERLEAVED_Q8_0,
                INTERLEAVED_Q4_K, INTERLEAVED_Q6_K)
_INTERLEAVED_NAMES = [f"{BLOCK_FORMATS[t - INTERLEAVED_TYPES][0]} ({t})" for t in _INTERLEAVED]


def block_format(weight_type: int) -> tuple[str, int, int]:
    """``(name, values per block, bytes per block)`` of a weight type the quantized ops take:
    :data:`BLOCK_FORMATS`, or an interleaved one (``INTERLEAVED_*``: their blocks, each row's
    bytes in another order). A ValueError names the types for any other."""
    if weight_type in _INTERLEAVED:
        name, values, block_bytes = BLOCK_FORMATS[weight_type - INTERLEAVED_TYPES]
        return f"{name} interleaved by 16", values, block_bytes
    if weight_type not in BLOCK_FORMATS:
        names = ", ".join(f"{name} ({type_id})" for type_id, (name, _, _) in BLOCK_FORMATS.items())
        interleaved = ", ".join(_INTERLEAVED_NAMES[:-1]) + " or " + _INTERLEAVED_NAMES[-1]
        raise ValueError(f"weight_type must be a ggml type id of {names}, got {weight_type} "
                         f"(the CPU also takes {interleaved} with rows interleaved by 16)")
    return BLOCK_FORMATS[weight_type]


def cpu_decode_layout(weight: Tensor, weight_type: int) -> tuple[Tensor, int]:
    """``(weight, weight_type)`` in the layout the CPU's decode kernels read fastest, for a
    weight of :func:`quantized_linear` kept on this CPU: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K or Q6_K
    with a multiple of 16 rows, where the CPU kernels run AVX-512 (``fastllm._C.cpu_isa()`` amx or
    avx512), becomes its interleaved type (``INTERLEAVED_TYPES + weight_type``, a copy): one
    64-byte load then holds 4 values of each of 16 rows, and one 8-bit multiply-add serves them
    all. Anything else is returned as it is. The result is the same weight to
    :func:`quantized_linear` and :func:`dequantize` on the CPU (decode rows' last bits aside:
    other sums in another order); with another instruction set chosen later
    (``fastllm._C.set_cpu_isa``) they put its rows back in order at each call."""
    if (INTERLEAVED_TYPES + weight_type in _INTERLEAVED and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.shape[0] % 16 == 0
            and _C.cpu_isa() in ("amx", "avx512")):
        return _C.interleave_rows(weight, weight_type), INTERLEAVED_TYPES + weight_type
    return weight, weight_type


def quantized_rows(weight: Tensor, weight_type: int, rows: Tensor) -> tuple[Tensor, int]:
    """Rows ``rows`` (integer indices, any shape) of a weight of :func:`quantized_linear` as
    ``(blocks, ggml type)``, ``blocks`` uint8 ``[*rows.shape, row bytes]``: ``weight[rows]``, or,
    for an interleaved type (:func:`cpu_decode_layout`), those rows of the ggml blocks it came
    from. An embedding looks its rows up so in a table that is also the LM head."""
    if weight_type not in _INTERLEAVED:
        return weight[rows], weight_type
    ggml_type = weight_type - INTERLEAVED_TYPES
    blocks = _C.deinterleave_rows(weight, weight_type, rows.reshape(-1))
    return blocks.view(*rows.shape, weight.shape[1]), ggml_type


@contextlib.contextmanager
def trusted_inputs() -> Iterator[None]:
    """Within this block (on this thread) the caller vouches for the index values it passes
    to the ops: ``cu_seqlens``, ``block_tables``, ``seq_lens``, ``slot_mapping``, ``positions``
    and the sampling parameters.

    On the CPU the ops check those values anyway (it costs nothing). On a GPU, checking them
    means copying them to the host and waiting for the device, once per call: inside this block
    GPU ops skip those checks (shapes, dtypes and devices are still checked), as they do while
    a CUDA graph is being captured. Kernels never read or write out of bounds either way, but a
    bad value gives a wrong result instead of a ``ValueError``. On CUDA, ``sample`` then marks
    a row whose logits hold NaN or +inf, or no finite value, with token -1 instead of raising.
    The engine builds and checks its metadata on the host, then runs its steps in this block.
    """
    with _thread_flag(_C.set_trusted_inputs, True):
        yield


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Within this block (on this thread, ``enabled``) the CPU ops compute each row the same
    way whatever the other rows of the call: ``linear`` and ``quantized_linear`` keep their
    few-row kernels for any number of rows (no switch to a GEMM), and ``attention`` /
    ``paged_attention`` give every query row the same tiles and key blocks whether it decodes
    alone, sits in a prefill chunk or in a batch, with no split over the keys. Norms, RoPE and
    sampling are per row anyway. A seeded request's tokens then do not depend on the batch, the
    chunking or a preemption, in every dtype; prefill is slower (no GEMM) and batch-1 decode
    attention runs one thread per kv head. CUDA kernels ignore it.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    with _thread_flag(_C.set_batch_invariant, enabled):
        yield


@contextlib.contextmanager
def _thread_flag(setter: Callable[[bool], bool], value: bool) -> Iterator[None]:
    """Sets one of ``_C``'s per-thread flags for the block, then restores it."""
    previous = setter(value)
    try:
        yield
    finally:
        setter(previous)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = True,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    out: Tensor | None = None,
) -> Tensor:
    """Attention over packed variable-length sequences (flash-attention's varlen layout).

    Args:
        q: ``[total_q, n_heads, head_dim]``, sequences packed back to back, no padding.
        k, v: ``[total_k, n_kv_heads, head_dim]``; ``n_heads % n_kv_heads == 0`` (GQA/MQA: query
            head ``h`` reads kv head ``h // (n_heads // n_kv_heads)``, by index, never copied).
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` offsets of each sequence (start at 0,
            non-decreasing, end at the packed totals). Sequences of length 0 are allowed.
        max_seqlen_q, max_seqlen_k: upper bounds of the per-sequence lengths.
        causal: bottom-right aligned causal mask: query ``i`` of a sequence with ``len_q``
            queries and ``len_k`` keys sees keys ``j <= i + len_k - len_q``, so prefill, chunked
            prefill and decode are the same op. Computed from indices, never materialized.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        window_left: ``>= 0`` restricts query ``i`` to keys ``j >= i + len_k - len_q - window_left``
            (sliding window); ``-1`` disables it.
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``): ``> 0`` turns each
            scaled score ``s = scale * q . k`` into ``softcap * tanh(s / softcap)`` before the
            mask and the softmax; ``0`` (the default) disables it. Other values must lie in
            float32's normal range: negative, NaN or infinite ones are a ``ValueError``.
        out: optional preallocated result (q's shape, dtype and device; any strides), written
            in place and returned, so a decode loop allocates nothing.

    Returns:
        ``[total_q, n_heads, head_dim]`` in q's dtype (float32, bfloat16 or float16; float32
        accumulation). A query that sees no key (``len_k == 0``, or rows above the diagonal when
        ``len_q > len_k``) gets zeros, as in flash-attention.
    """
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    kwargs = dict(causal=bool(causal), scale=None if scale is None else float(scale),
                  window_left=int(window_left), softcap=float(softcap))
    if out is None:
        return torch.ops.fastllm.attention.default(*args, **kwargs)
    torch.ops.fastllm.attention_out.default(*args, **kwargs, out=out)
    return out


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor,
    max_seqlen_q: int,
    *,
    causal: bool = True,
    scale: float | None = None,
    window_left: int = -1,
    rotary_cos_sin_cache: Tensor | None = None,
    rotary_is_neox: bool = True,
    softcap: float = 0.0,
) -> Tensor:
    """:func:`attention` with each sequence's keys read from paged caches through its block table.

    Args:
        q: ``[total_q, n_heads, head_dim]``, packed as in :func:`attention`.
        k_cache, v_cache: ``[num_blocks, block_size, n_kv_heads, head_dim]``; key ``j`` of
            sequence ``b`` is in block ``block_tables[b, j // block_size]`` at offset
            ``j % block_size`` (written there by :func:`reshape_and_cache`). In q's dtype, or,
            under float32 q, in bfloat16 or float16 (vLLM's ``kv_cache_dtype``): read back as
            float32, exactly, so the result is that of float32 K/V holding the stored values
            (the CPU kernel and the composite; on CUDA the caches must be in q's dtype).
        block_tables: int32 ``[batch, max_blocks_per_seq]``; entries past a sequence's length
            are never read.
        seq_lens: int32 ``[batch]``, each sequence's number of keys, its new queries' own tokens
            included.
        cu_seqlens_q, max_seqlen_q: the queries' offsets and longest length, as in
            :func:`attention`.
        rotary_cos_sin_cache: position-independent (pre-RoPE) mode: the caches hold keys
            *before* rotary embedding, and key ``j`` of each sequence is rotated by position ``j``
            as it is read, with this float32 ``[max_position, rotary_dim]`` table (the layout
            of :func:`rope_cos_sin_cache`; channels past ``rotary_dim`` are not rotated). The
            queries must come already rotated by their own positions. Cached keys then carry no
            position, so a cached chunk can be placed at any offset of any sequence.
        rotary_is_neox: the pairing of rotated channels, as in :func:`rotary_embedding`.
        softcap: logit soft-capping, as in :func:`attention` (``0``: off).

    Decode is one query per sequence; chunked prefill is many queries against a cached prefix
    plus themselves; the bottom-right causal mask, sliding window, soft-cap and GQA are those
    of :func:`attention`.
    """
    return torch.ops.fastllm.paged_attention.default(
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, int(max_seqlen_q),
        causal=bool(causal), scale=None if scale is None else float(scale),
        window_left=int(window_left), rotary_cos_sin_cache=rotary_cos_sin_cache,
        rotary_is_neox=bool(rotary_is_neox), softcap=float(softcap))


def reshape_and_cache(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor) -> None:
    """Writes new tokens' K and V rows into their cache slots, in place.

    Args:
        key, value: ``[tokens, n_kv_heads, head_dim]``, one dtype.
        k_cache, v_cache: ``[num_blocks, block_size, n_kv_heads, head_dim]``, in key's dtype
            or, under float32 key and value, in bfloat16 or float16: each value is then rounded
            to nearest even, as ``Tensor.to`` rounds.
        slot_mapping: int64 ``[tokens]``; token ``t`` goes to block ``slot // block_size``,
            offset ``slot % block_size``; a negative slot skips the token (padding). A slot past
            the cache is a ``ValueError`` and nothing is written.

    Caches that share memory with each other or with ``key`` / ``value``, or that reach one
    element through several indices (an expanded tensor), are a ``ValueError``.
    """
    torch.ops.fastllm.reshape_and_cache.default(key, value, k_cache, v_cache, slot_mapping)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias``: ``torch.nn.functional.linear`` for 2-D inputs.

    Args:
        x: ``[rows, in_features]``.
        weight: ``[out_features, in_features]`` with contiguous rows (an ``nn.Linear`` weight),
            on x's device, in x's dtype; or, under float32 ``x``, in bfloat16 or float16
            (weights stored in 16 bits, converted exactly as they are read).
        bias: ``[out_features]`` or None.

    Returns ``[rows, out_features]`` in x's dtype, summed in float32. On the CPU, few rows (a
    decode step: up to 64 in float32, 8 in bfloat16, 4 in float16) run a kernel that streams
    each weight row from memory once, near the memory bandwidth; more rows use ATen's GEMM.
    """
    return torch.ops.fastllm.linear.default(x, weight, bias)


def quantized_linear(x: Tensor, weight: Tensor, weight_type: int,
                     bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` with ``W`` block-quantized.

    Args:
        x: ``[rows, in_features]``, float32, bfloat16 or float16.
        weight: uint8 ``[out_features, row bytes]``: ggml's blocks of ``weight_type``, row by row
            (:data:`BLOCK_FORMATS`: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K;
            ``in_features`` values per row, whole blocks: a multiple of 256 for the K-quants),
            on x's device; on the CPU also in :func:`cpu_decode_layout`'s order.
        weight_type: the ggml type id (``gguf.GGMLQuantizationType``), or on the CPU an
            interleaved type (``INTERLEAVED_*``).
        bias: ``[out_features]`` in x's dtype, or None.

    Returns ``[rows, out_features]`` in x's dtype. On the CPU a few rows (a decode step, up to
    32) quantize the activations to int16 blocks of 32 (int8 for Q4_0 and the K-quants, as
    llama.cpp does) and take integer dot products with the weight's blocks (AVX-512 VNNI, or
    AVX2, or plain C++: the widest the CPU has, or the environment variable
    ``FASTLLM_CPU_ISA=amx|avx512|avx2|scalar``), streaming the weight once in its own size;
    more rows take a GEMM: with AMX, oneDNN's bfloat16 GEMM on dequantized tiles; with AVX-512
    or AVX2, Q4_0's and the K-quants' on those 8-bit activations; else on dequantized tiles of
    the weight. On CUDA up to 8 rows run a GEMV
    that decodes the blocks in registers (float32 sums); more rows dequantize the weight to x's
    dtype for cuBLAS. Within those decode rows a row's result does not depend on the others.
    """
    return torch.ops.fastllm.quantized_linear.default(x, weight, weight_type, bias)


def dequantize(weight: Tensor, weight_type: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The rows of a block-quantized weight (as :func:`quantized_linear` takes it) as
    ``[rows, in_features]`` floats of ``dtype``."""
    return torch.ops.fastllm.dequantize.default(weight, weight_type, dtype)


def rotary_embedding(
    positions: Tensor,
    q: Tensor,
    k: Tensor | None,
    cos_sin_cache: Tensor,
    *,
    is_neox: bool = True,
    rotary_dim: int | None = None,
) -> None:
    """Applies rotary position embedding to ``q`` and ``k`` in place.

    Args:
        positions: int64 or int32 ``[tokens]``, each in ``[0, cos_sin_cache.shape[0])``.
        q: ``[tokens, n_heads, head_dim]``; k: ``[tokens, n_kv_heads, head_dim]`` or None.
            Strided views (for example slices of a fused QKV projection) are rotated in place;
            ``q`` and ``k`` sharing an element, or either reaching one element through several
            indices (an expanded tensor), is a ``ValueError`` (it would be rotated twice).
        cos_sin_cache: ``[max_position, rotary_dim]``, cos in the first half of each row and sin
            in the second (see :func:`rope_cos_sin_cache`).
        is_neox: True rotates channel ``i`` with ``i + rotary_dim/2`` (HF Llama/Qwen); False
            rotates interleaved pairs ``(2i, 2i+1)`` (llama2.c, GGUF).
        rotary_dim: channels rotated per head (the first ones; the rest pass through). Defaults
            to ``cos_sin_cache.shape[1]`` and must equal it when given.
    """
    torch.ops.fastllm.rotary_embedding.default(
        positions, q, k, cos_sin_cache, is_neox=bool(is_neox),
        rotary_dim=None if rotary_dim is None else int(rotary_dim),
    )


def rotary_and_cache(
    positions: Tensor,
    q: Tensor,
    key: Tensor,
    value: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    cos_sin_cache: Tensor | None,
    q_norm: Tensor | None = None,
    k_norm: Tensor | None = None,
    eps: float = 1e-6,
    *,
    is_neox: bool = True,
    rotate_keys: bool = True,
) -> None:
    """An attention block's steps between its QKV projection and attention, in one op.

    ``q`` and ``key`` are RMS-normalized per head by ``q_norm`` / ``k_norm`` if given (Qwen3's
    q/k norms, :func:`rms_norm`'s arithmetic), then rotated in place as
    :func:`rotary_embedding` rotates them if ``cos_sin_cache`` is given (``key`` only with
    ``rotate_keys``; False leaves the cached keys before RoPE, for
    :func:`paged_attention`'s ``rotary_cos_sin_cache``); then ``key`` and ``value`` are written
    to their cache slots as :func:`reshape_and_cache` writes them. The same result as those
    three ops in that order; on CUDA one kernel instead of four.

    Args:
        positions: int64 or int32 ``[tokens]``.
        q: ``[tokens, n_heads, head_dim]``; key, value: ``[tokens, n_kv_heads, head_dim]``, one
            dtype (strided views of one projection are fine; q and key are updated in place).
        k_cache, v_cache, slot_mapping: as :func:`reshape_and_cache` takes them.
        cos_sin_cache: as :func:`rotary_embedding` takes it, or None (no RoPE: a NoPE layer).
        q_norm, k_norm: ``[head_dim]`` weights in q's dtype, both or neither.
        eps: the norms' epsilon.
    """
    torch.ops.fastllm.rotary_and_cache.default(
        positions, q, key, value, k_cache, v_cache, slot_mapping, cos_sin_cache, q_norm, k_norm,
        float(eps), is_neox=bool(is_neox), rotate_keys=bool(rotate_keys))


def rope_cos_sin_cache(
    max_position: int,
    rotary_dim: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Tensor:
    """The ``[max_position, rotary_dim]`` cos|sin table :func:`rotary_embedding` reads.

    Frequencies are ``base ** (-2i / rotary_dim)`` as in HF transformers' default RoPE; computed
    in float64 and rounded once to ``dtype``.
    """
    if max_position <= 0 or rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(
            f"need max_position > 0 and an even rotary_dim > 0, got {max_position=}, {rotary_dim=}"
        )
    if not (base > 0 and math.isfinite(base)):
        raise ValueError(f"base must be a positive number, got {base}")
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype=dtype, device=device)


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    offsets: Tensor,
) -> Tensor:
    """Samples one token per row of ``logits``, every control given per row.

    Row ``r`` is filtered in HF transformers' order: temperature (``0`` = greedy argmax, the
    first maximum; so is a temperature so small that its float32 reciprocal overflows, below
    about ``3e-39``), top-k (``<= 0`` or ``>= vocab`` = off; every token tied with the k-th
    value stays, as in ``TopKLogitsWarper``), top-p (``1`` = off; a token stays when the
    probability mass of the tokens strictly more likely than it is below ``top_p``, so tokens
    tied at the boundary stay together), min-p (``0`` = off; a token stays when its probability
    is at least ``min_p`` times the largest). None of them sorts the vocabulary.

    The draw is one uniform number from Philox4x32-10 keyed by ``seeds[r]`` with counter
    ``offsets[r]`` (a request's step), inverted through the filtered distribution in vocabulary
    order: a row's token depends on its logits, parameters, seed and offset only, never on the
    other rows, their order or the thread count.

    Args:
        logits: ``[batch, vocab]`` float32 / bfloat16 / float16, finite or ``-inf``.
        temperature, top_p, min_p: float32 ``[batch]``.
        top_k: int32 ``[batch]``.
        seeds, offsets: int64 ``[batch]``.

    Returns:
        int64 ``[batch]`` token ids. A row with a NaN or ``+inf`` logit, or no finite logit, is
        a ``ValueError`` naming the row.
    """
    return torch.ops.fastllm.sample.default(logits, temperature, top_k, top_p, min_p, seeds,
                                            offsets)


def sample_with_logprobs(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    min_p: Tensor,
    seeds: Tensor,
    offsets: Tensor,
    num_logprobs: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`sample`, plus log-probabilities under the distribution each token was drawn from.

    A sampled row reports the filtered, temperature-scaled distribution (filtered-out tokens,
    and tokens whose probability underflows float32, have probability 0, so the draw can never
    pick them); a greedy row (temperature 0) reports ``log_softmax(logits)``, the distribution
    its argmax was taken of. Computed in the sampling pass, without another pass
    over the vocabulary.

    Returns:
        ``(tokens, token_logprobs, top_ids, top_logprobs)``: int64 ``[batch]``, float32
        ``[batch]``, int64 ``[batch, num_logprobs]`` and float32 ``[batch, num_logprobs]``, the
        most likely tokens first (ties by lower id); slots past the tokens that have any
        probability hold id ``-1`` and ``-inf``.
    """
    return torch.ops.fastllm.sample_with_logprobs.default(
        logits, temperature, top_k, top_p, min_p, seeds, offsets, int(num_logprobs))


def apply_penalties(
    logits: Tensor,
    prompt_mask: Tensor,
    output_counts: Tensor,
    repetition_penalty: Tensor,
    frequency_penalty: Tensor,
    presence_penalty: Tensor,
    logit_bias: Tensor | None = None,
) -> None:
    """Applies logit bias and repetition / frequency / presence penalties to ``logits`` in place.

    In order, per row ``r`` and token ``t``:

    1. ``logits += logit_bias`` (when given);
    2. repetition penalty (HF / vLLM): when ``t`` is in the prompt or the output so far,
       ``logit / p`` if ``logit > 0`` else ``logit * p`` (``p = 1`` = off);
    3. ``logit -= frequency_penalty * output_counts[r, t]``;
    4. ``logit -= presence_penalty * (output_counts[r, t] > 0)`` (OpenAI / vLLM semantics).

    Args:
        logits: ``[batch, vocab]`` float32 / bfloat16 / float16, modified in place; one that
            reaches an element through several indices (an expanded tensor) is a
            ``ValueError``.
        prompt_mask: bool ``[batch, vocab]``, True for tokens in the prompt.
        output_counts: int32 ``[batch, vocab]``, occurrences in the generated tokens.
        repetition_penalty, frequency_penalty, presence_penalty: float32 ``[batch]``.
        logit_bias: float32 ``[batch, vocab]`` or None.
    """
    torch.ops.fastllm.apply_penalties.default(logits, prompt_mask, output_counts,
                                              repetition_penalty, frequency_penalty,
                                              presence_penalty, logit_bias)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF's RMSNorm: ``weight * (x * rsqrt(mean(x**2, -1) + eps))``, normalized in float32,
    rounded to x's dtype, then scaled by ``weight`` in that dtype.

    Args:
        x: ``[..., hidden]`` (at most 3-D, e.g. ``[tokens, heads, head_dim]`` for q/k norms),
            float32 / bfloat16 / float16, unit stride in the last dim (other strides free: a
            strided view of a fused projection needs no copy).
        weight: ``[hidden]``, x's dtype and device.
        eps: added to the mean square, finite and >= 0.

    Returns a new contiguous tensor of x's shape. Each row is computed on its own (same bits
    alone or in a batch).
    """
    return torch.ops.fastllm.rms_norm.default(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    """A pre-norm block's residual step, in place: ``residual += x`` (rounded to the dtype, as
    the eager ``x + residual``), then ``x = rms_norm(residual, weight, eps)``.

    Args:
        x: contiguous ``[rows, hidden]``: a sublayer's output in, the next sublayer's normalized
            input out.
        residual: contiguous, x's shape, dtype and device, sharing no memory with x: the
            residual stream, updated in place.
        weight: ``[hidden]``; eps as in :func:`rms_norm`.
    """
    torch.ops.fastllm.add_rms_norm.default(x, residual, weight, eps)


def silu_and_mul(x: Tensor) -> Tensor:
    """SwiGLU's gate: ``silu(x[:, :d]) * x[:, d:]`` for a fused gate|up projection
    ``x`` ``[rows, 2 * d]`` (unit stride in the last dim), with the eager form's roundings
    (silu rounded to x's dtype before the product). Returns ``[rows, d]``."""
    return torch.ops.fastllm.silu_and_mul.default(x)


def gelu_tanh_and_mul(x: Tensor) -> Tensor:
    """GeGLU's gate (Gemma's MLP): ``gelu(x[:, :d], approximate="tanh") * x[:, d:]`` for a fused
    gate|up projection ``x`` ``[rows, 2 * d]`` (unit stride in the last dim), with the eager
    form's roundings (gelu rounded to x's dtype before the product), as :func:`silu_and_mul`.
    Returns ``[rows, d]``."""
    return torch.ops.fastllm.gelu_tanh_and_mul.default(x)


def moe(
    x: Tensor,
    router_logits: Tensor,
    gate_up: Tensor,
    down: Tensor,
    top_k: int,
    renormalize: bool,
    *,
    gate_up_type: int | None = None,
    down_type: int | None = None,
) -> Tensor:
    """A mixture-of-experts MLP block (Qwen3-MoE's ``Qwen3MoeSparseMoeBlock``, Mixtral's
    ``MixtralSparseMoeBlock``) after its router's linear layer, with HF's eager arithmetic.

    Each token's routing weights are ``softmax(router_logits)`` in float32; it goes to the
    ``top_k`` most likely experts (as ``torch.topk`` picks them, ties included, on the CPU and
    in the composite; on CUDA a tie goes to the lower expert id), whose weights are divided by
    their sum if ``renormalize`` (Qwen3's ``norm_topk_prob``; Mixtral always), then rounded to
    x's dtype. Expert ``e`` computes ``down[e] @ (silu(gate) * up)`` with
    ``gate | up = gate_up[e] @ x[t]``, in x's dtype with the eager roundings (each linear's
    output, silu, the product); each token's expert outputs times their weights are added in
    increasing expert order, each product and sum rounded to x's dtype (HF's ``index_add_``).
    Mixtral's block multiplies by the float32 weight instead (one rounding less under
    bfloat16 / float16; the same in float32).

    Args:
        x: ``[tokens, hidden]``, float32, bfloat16 or float16.
        router_logits: ``[tokens, num_experts]`` float32 / bfloat16 / float16: the router's
            linear output, computed by the caller.
        gate_up: every expert's gate rows then up rows, ``[num_experts, 2 * intermediate,
            hidden]`` in x's dtype (or bfloat16 / float16 under float32 x: converted exactly
            as :func:`linear` converts them), rows contiguous; or, with ``gate_up_type``,
            ggml blocks uint8 ``[num_experts, 2 * intermediate, row bytes]`` as
            :func:`quantized_linear` takes a weight (:data:`BLOCK_FORMATS`).
        down: ``[num_experts, hidden, intermediate]``, or blocks with ``down_type``; its format
            may differ from gate_up's.
        top_k: experts per token, in ``[1, num_experts]``.
        renormalize: divide the chosen experts' probabilities by their sum.
        gate_up_type, down_type: ggml type ids of quantized experts, None for float ones.

    Returns ``[tokens, hidden]`` in x's dtype. On the CPU the (token, expert) pairs are
    grouped by expert; an expert with few rows (every expert of a decode step: up to the
    few-row limits of :func:`linear` and :func:`quantized_linear`) streams only its own weight
    rows, once, and all of them share one parallel region; an expert with more rows runs a
    GEMM over its rows. Under :func:`batch_invariant` a token's result does not depend on the
    others. On CUDA up to 8 tokens (or while a CUDA graph is captured) a GEMV per (token,
    expert) reads the chosen experts' rows without any host sync; more tokens wait once for
    the per-expert counts and run one cuBLAS GEMM (quantized: :func:`quantized_linear`'s path)
    per expert that has tokens.
    """
    return torch.ops.fastllm.moe.default(
        x, router_logits, gate_up, down, int(top_k), bool(renormalize),
        gate_up_type=None if gate_up_type is None else int(gate_up_type),
        down_type=None if down_type is None else int(down_type))


# Fake kernels: output metadata for torch.compile. Metadata checks stay in C++ (one place for all
# devices); the one check repeated here is the device check, because mixing in a meta tensor
# routes the call to these functions instead of a real kernel.
def _register_fake(name: str):
    """Registers the decorated function as the fake kernel of ``name`` in both namespaces of the
    schemas (``csrc/ops.cpp``): fastllm and fastllm_composite."""

    def register(fake):
        for namespace in ("fastllm", "fastllm_composite"):
            torch.library.register_fake(f"{namespace}::{name}")(fake)
        return fake

    return register


def _check_one_device(**tensors: Tensor | None) -> None:
    named = [(name, t) for name, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; "
                             "all inputs must be on one device")


@_register_fake("attention")
def _attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                    causal=True, scale=None, window_left=-1, softcap=0.0):
    _check_one_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return q.new_empty(q.shape)


@_register_fake("attention_out")
def _attention_out_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                        causal=True, scale=None, window_left=-1, out, softcap=0.0):
    _check_one_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, out=out)


@_register_fake("linear")
def _linear_fake(x, weight, bias=None):
    _check_one_device(x=x, weight=weight, bias=bias)
    return x.new_empty((x.shape[0], weight.shape[0]))


@_register_fake("quantized_linear")
def _quantized_linear_fake(x, weight, weight_type, bias=None):
    _check_one_device(x=x, weight=weight, bias=bias)
    return x.new_empty(x.shape[0], weight.shape[0])


@_register_fake("dequantize")
def _dequantize_fake(weight, weight_type, dtype):
    _, values, block_bytes = block_format(weight_type)
    return weight.new_empty(weight.shape[0], weight.shape[1] // block_bytes * values, dtype=dtype)


@_register_fake("rotary_embedding")
def _rotary_embedding_fake(positions, q, k, cos_sin_cache, *, is_neox=True, rotary_dim=None):
    _check_one_device(positions=positions, q=q, k=k, cos_sin_cache=cos_sin_cache)


@_register_fake("rotary_and_cache")
def _rotary_and_cache_fake(positions, q, key, value, k_cache, v_cache, slot_mapping,
                           cos_sin_cache, q_norm=None, k_norm=None, eps=1e-6, *, is_neox=True,
                           rotate_keys=True):
    _check_one_device(positions=positions, q=q, key=key, value=value, k_cache=k_cache,
                      v_cache=v_cache, slot_mapping=slot_mapping, cos_sin_cache=cos_sin_cache)


@_register_fake("sample")
def _sample_fake(logits, temperature, top_k, top_p, min_p, seeds, offsets):
    _check_one_device(logits=logits, temperature=temperature, top_k=top_k, top_p=top_p,
                      min_p=min_p, seeds=seeds, offsets=offsets)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


@_register_fake("sample_with_logprobs")
def _sample_with_logprobs_fake(logits, temperature, top_k, top_p, min_p, seeds, offsets,
                               num_logprobs):
    tokens = _sample_fake(logits, temperature, top_k, top_p, min_p, seeds, offsets)
    batch = logits.shape[0]
    return (tokens, logits.new_empty((batch,), dtype=torch.float32),
            logits.new_empty((batch, num_logprobs), dtype=torch.int64),
            logits.new_empty((batch, num_logprobs), dtype=torch.float32))


@_register_fake("apply_penalties")
def _apply_penalties_fake(logits, prompt_mask, output_counts, repetition_penalty,
                          frequency_penalty, presence_penalty, logit_bias=None):
    _check_one_device(logits=logits, prompt_mask=prompt_mask, output_counts=output_counts,
                      repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
                      presence_penalty=presence_penalty, logit_bias=logit_bias)


@_register_fake("paged_attention")
def _paged_attention_fake(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q,
                          max_seqlen_q, *, causal=True, scale=None, window_left=-1,
                          rotary_cos_sin_cache=None, rotary_is_neox=True, softcap=0.0):
    _check_one_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                      seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q,
                      rotary_cos_sin_cache=rotary_cos_sin_cache)
    return q.new_empty(q.shape)


@_register_fake("reshape_and_cache")
def _reshape_and_cache_fake(key, value, k_cache, v_cache, slot_mapping):
    _check_one_device(k_cache=k_cache, key=key, value=value, v_cache=v_cache,
                      slot_mapping=slot_mapping)


@_register_fake("rms_norm")
def _rms_norm_fake(x, weight, eps):
    _check_one_device(x=x, weight=weight)
    return x.new_empty(x.shape)


@_register_fake("add_rms_norm")
def _add_rms_norm_fake(x, residual, weight, eps):
    _check_one_device(x=x, residual=residual, weight=weight)


@_register_fake("silu_and_mul")
def _silu_and_mul_fake(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@_register_fake("gelu_tanh_and_mul")
def _gelu_tanh_and_mul_fake(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@_register_fake("moe")
def _moe_fake(x, router_logits, gate_up, down, top_k, renormalize, *, gate_up_type=None,
              down_type=None):
    _check_one_device(x=x, router_logits=router_logits, gate_up=gate_up, down=down)
    return x.new_empty(x.shape)
