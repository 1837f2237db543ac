"""The decoder of every family (:mod:`fastllm.models.families`) in one model.

The forward pass runs on packed variable-length batches (sequences back to back, no padding)
against a :class:`~fastllm.kv_cache.PagedKVCache`: every layer writes its new K/V rows into the
cache, then attends over the cached keys through each sequence's block table. Prefill, chunked
prefill and decode are the same call; only the step's :class:`fastllm.ops.DecoderStep` differs.
Projections are plain matmuls, with q/k/v fused into one and gate/up into another (per expert in
a mixture-of-experts MLP). The family's record says which norms a layer has and how its config
sets the rest of the layer's record (:meth:`ModelConfig.layer_fields`: activation, scale,
soft-cap, window, RoPE table); the model code never branches on the architecture's name.

The modules hold the weights; the layers run as :class:`fastllm.ops.DecoderLayers`, the same ops
called from C++ (a decode step's ten small ops a layer cost more from Python than they compute),
each layer described by one :class:`fastllm.ops.DecoderLayer` record.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor, nn

from fastllm import ops
from fastllm.kv_cache import KVCacheSpec, PagedKVCache, cache_dtype_serves
from fastllm.models.config import ModelConfig
from fastllm.models.quantized import QuantizedEmbedding, QuantizedLinear
from fastllm.models.rope import build_cos_sin_cache
from fastllm.models.tensor_parallel import ShardLayout, TensorParallel

__all__ = ["DEFAULT_ROPE_POSITIONS", "DecoderLM"]

# Rows of the RoPE table a model is loaded with, when its context is longer: the engine's
# default context (entrypoints/client.py), so a default LLM never rebuilds the table; an engine
# with a longer one grows it (DecoderLM.reserve_positions). A table of the full context could
# take gigabytes (max_position_embeddings is 10**9 in a bad config, 10**7 in some real ones).
DEFAULT_ROPE_POSITIONS = 8192
# One growth of a shared model's table at a time.
_ROPE_TABLE_LOCK = threading.Lock()


class LoRALayers(Protocol):
    """What :meth:`DecoderLM.forward` reads of LoRA adapter slots
    (:class:`fastllm.lora.LoRASlots`)."""

    layers: Sequence[Mapping[str, ops.ProjectionLoRA]]


class Linear(nn.Linear):
    """``nn.Linear`` through :func:`fastllm.ops.linear` (a decode step streams its weights
    at memory bandwidth); parameters and names as ``nn.Linear``'s. Inputs ``[tokens, in]``."""

    def reset_parameters(self) -> None:
        # On the meta device (a model built to be loaded into) there are no values to set.
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias)

    def projection_parts(self) -> list[ops.ProjectionPart]:
        """This layer as :class:`fastllm.ops.DecoderLayers` runs it."""
        return [ops.ProjectionPart(self.weight, None, self.bias)]


class RMSNorm(nn.Module):
    """HF's RMSNorm (normalized in float32, cast back, then scaled by the weight) as one op.
    Given the residual stream too, it first adds ``x`` into it, in place (the pre-norm block's
    residual step, fused), and returns ``(normalized, residual)``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        ops.add_rms_norm(x, residual, self.weight, self.eps)
        return x, residual


class Attention(nn.Module):
    """Fused QKV projection, optional q/k RMSNorm, RoPE, paged cache write and attention
    (run by :class:`fastllm.ops.DecoderLayers`), over the heads of ``shard``."""

    def __init__(self, config: ModelConfig, layer: int, shard: ShardLayout) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = shard.n_heads, shard.n_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias and shard.row_bias)
        self.qk_norm = config.family.qk_norm
        if self.qk_norm is not None:  # per head, or over all of q and all of k
            per_head = self.qk_norm == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim if per_head else kv_size, config.rms_norm_eps)

    def record_fields(self) -> dict:
        """Attention's fields of the layer's :class:`fastllm.ops.DecoderLayer`."""
        has_norms = self.qk_norm is not None
        return dict(qkv=self.qkv_proj.projection_parts(), o=self.o_proj.projection_parts(),
                    n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
                    q_norm=self.q_norm.weight if has_norms else None,
                    k_norm=self.k_norm.weight if has_norms else None)


class MLP(nn.Module):
    """A gated MLP: ``down(act(gate(x)) * up(x))``, gate and up as one matmul (run by
    :class:`fastllm.ops.DecoderLayers`), over ``intermediate_size`` features."""

    def __init__(self, config: ModelConfig, intermediate_size: int, row_bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate_size,
                                   bias=config.mlp_bias)
        self.down_proj = Linear(intermediate_size, config.hidden_size,
                                bias=config.mlp_bias and row_bias)

    def record_fields(self) -> dict:
        """The MLP's fields of the layer's :class:`fastllm.ops.DecoderLayer`."""
        return dict(gate_up=self.gate_up_proj.projection_parts(),
                    down=self.down_proj.projection_parts())


class Experts(nn.Module):
    """A mixture-of-experts MLP (run by :func:`fastllm.ops.moe`): the ``router`` scores the
    experts, each token runs its ``num_experts_per_tok`` best. ``gate_up_proj`` ``[experts, 2 *
    intermediate, hidden]`` (each expert's gate rows, then its up rows) and ``down_proj``
    ``[experts, hidden, intermediate]`` are floats, or blocks (uint8, last dim the row's bytes)
    of ``gate_up_type`` / ``down_type``: a ggml type, or :data:`fastllm.ops.FP8_E4M3`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, inter, hidden = (config.num_experts, config.moe_intermediate_size,
                                  config.hidden_size)
        self.router = Linear(hidden, experts, bias=False)
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.gate_up_type: int | None = None
        self.down_type: int | None = None
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob

    def record_fields(self) -> dict:
        """The experts' field of the layer's :class:`fastllm.ops.DecoderLayer`."""
        return dict(experts=ops.Experts(
            router=self.router.projection_parts(), gate_up=self.gate_up_proj,
            down=self.down_proj, top_k=self.top_k, renormalize=self.renormalize,
            gate_up_type=self.gate_up_type, down_type=self.down_type))


class DecoderLayer(nn.Module):
    """Attention, then the MLP, each a residual branch with the family's norms
    (:data:`~fastllm.models.families.NORM_ROLES`: before and after each branch), each residual
    add fused into the norm after it (:class:`fastllm.ops.DecoderLayer`)."""

    def __init__(self, config: ModelConfig, layer: int, shard: ShardLayout) -> None:
        super().__init__()
        self.norm_roles = tuple(config.family.norm_names)
        for role in self.norm_roles:
            self.add_module(role, RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.self_attn = Attention(config, layer, shard)
        if config.moe_layers[layer]:
            self.mlp = Experts(config)
        else:
            self.mlp = MLP(config, shard.intermediate_size, shard.row_bias)
        self.layer_fields = config.layer_fields(layer)

    def record(self) -> ops.DecoderLayer:
        """This layer, with its current weights, as :class:`fastllm.ops.DecoderLayers` runs
        it."""
        norms = {role: getattr(self, role).weight for role in self.norm_roles}
        return ops.DecoderLayer(
            input_norm=norms.get("input_layernorm"),
            post_attention_norm=norms.get("post_attention_layernorm"),
            pre_feedforward_norm=norms.get("pre_feedforward_layernorm"),
            post_feedforward_norm=norms.get("post_feedforward_layernorm"),
            **self.self_attn.record_fields(), **self.mlp.record_fields(), **self.layer_fields)


class DecoderLM(nn.Module):
    """A decoder-only causal LM of any family :mod:`fastllm.models.families` describes, for
    inference (no parameter needs grad).

    Parameter names are fastllm's own (``layers.{i}.self_attn.qkv_proj.weight``, ...);
    :func:`fastllm.models.loader.load_model` maps HF checkpoints onto them. With tied
    embeddings there is no ``lm_head``: :meth:`compute_logits` reads ``embed_tokens.weight``.

    :meth:`forward` runs the layers as one :class:`fastllm.ops.DecoderLayers` call, bound to
    their weights and the RoPE tables at the first forward and again after ``load_state_dict``, a
    move (``.to()`` and the like) or a longer RoPE table (:meth:`reserve_positions`): op calls
    from Python cost more than the small ops of a decode step. Forward hooks on the layers
    therefore do not run; after replacing a submodule or parameter by hand, call
    :meth:`unbind_layers`.

    With ``tensor_parallel``, the model is that rank's shard (Megatron's:
    :mod:`fastllm.models.tensor_parallel`, laid out by :attr:`shard`): its layers hold the
    rank's heads and MLP features, its embedding and LM head a range of vocabulary rows.
    ``config`` still describes the whole model; :meth:`kv_cache_spec` gives the rank's
    key/value heads. :meth:`forward` and :meth:`compute_logits` are collective calls: every
    rank of the group makes them, in the same order, with the same inputs, and each gets the
    whole model's result (hidden states, full-vocabulary logits).
    """

    def __init__(self, config: ModelConfig,
                 tensor_parallel: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.tensor_parallel = tensor_parallel
        self.shard = shard = ShardLayout.of(config, tensor_parallel)
        self._bound_layers: ops.DecoderLayers | None = None
        # The layers bound with each LoRA slot holder's adapters too (one per engine serving
        # adapters on this model), for as long as the holder lives.
        self._bound_lora_layers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.register_load_state_dict_post_hook(lambda module, _: module.unbind_layers())
        # Initialized here rather than by nn.Embedding: on the meta device (a model built to be
        # loaded into) normal_ runs a decomposition that imports torch._dynamo, slowing a load.
        self.embed_tokens = nn.Embedding(shard.vocab_rows, config.hidden_size,
                                         _weight=torch.empty(shard.vocab_rows, config.hidden_size))
        if not self.embed_tokens.weight.is_meta:
            nn.init.normal_(self.embed_tokens.weight)
        self.layers = nn.ModuleList(DecoderLayer(config, i, shard)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings else
                        Linear(config.hidden_size, shard.vocab_rows, bias=False))
        # Derived from the config, never loaded: non-persistent, rebuilt by init_rope_cache.
        # The local table is the sliding layers' own (Gemma 3), empty for other families.
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.register_buffer("local_cos_sin_cache", torch.empty(0), persistent=False)
        # Tables reserve_positions replaced, kept alive: CUDA graphs captured before read them.
        self._replaced_rope_tables: list[Tensor] = []
        self.init_rope_cache()
        self.requires_grad_(False)

    def init_rope_cache(self, max_positions: int | None = None) -> None:
        """(Re)builds the RoPE tables on the parameters' device for positions below
        ``max_positions`` (default: the model's context, at most :data:`DEFAULT_ROPE_POSITIONS`),
        once per model, and again after materializing a model built on the meta device."""
        if max_positions is None:
            max_positions = min(self.config.max_position_embeddings, DEFAULT_ROPE_POSITIONS)
        device = self.embed_tokens.weight.device
        local = self.config.rope_local_theta is not None
        if device.type == "meta":
            shape = (max_positions, self.config.rotary_dim)
            self.cos_sin_cache = torch.empty(shape, device=device)
            self.local_cos_sin_cache = torch.empty(shape if local else 0, device=device)
        else:
            self.cos_sin_cache = build_cos_sin_cache(self.config, max_positions, device=device)
            self.local_cos_sin_cache = (
                build_cos_sin_cache(self.config, max_positions, device=device, local=True)
                if local else torch.empty(0, device=device))
        self.unbind_layers()  # the layers read the tables they were bound to

    def rope_tables(self) -> list[Tensor]:
        """The RoPE tables the layers index by their ``rope_table``: the model's, then the
        sliding layers' own when they have one."""
        if self.config.rope_local_theta is None:
            return [self.cos_sin_cache]
        return [self.cos_sin_cache, self.local_cos_sin_cache]

    def reserve_positions(self, max_model_len: int) -> None:
        """Makes the RoPE table cover positions below ``max_model_len`` (at most
        ``max_position_embeddings``): an engine calls this with its context before it runs.

        The table only grows: a pooled model is shared by engines of different contexts. The
        rows of a longer table equal those of the shorter one, so a running engine reads the
        same values from either.
        """
        with _ROPE_TABLE_LOCK:
            if max_model_len > self.cos_sin_cache.shape[0]:
                replaced = self.rope_tables()
                self.init_rope_cache(max_model_len)
                self._replaced_rope_tables.extend(replaced)

    def unbind_layers(self) -> None:
        """Forgets the bound layers: the next forward binds them to the weights and RoPE tables
        then in place."""
        self._bound_layers = None
        self._bound_lora_layers.clear()

    def _apply(self, fn, recurse: bool = True):  # every move or cast (.to, .cuda, to_empty...)
        self.unbind_layers()
        return super()._apply(fn, recurse)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms' weights', which are never quantized)."""
        return self.norm.weight.dtype

    def kv_cache_spec(self, block_size: int = 16,
                      dtype: torch.dtype | None = None) -> KVCacheSpec:
        """The KV cache this model needs, stored in ``dtype``: None for the activations' dtype,
        or bfloat16 / float16 under float32 activations (K/V rounded as they are cached, read
        back as float32; a cache wider than the activations is a ValueError). A
        tensor-parallel rank's cache holds its own key/value heads."""
        if dtype is None:
            dtype = self.dtype
        if not isinstance(dtype, torch.dtype) or not cache_dtype_serves(dtype, self.dtype):
            raise ValueError(f"a KV cache dtype must be the model's dtype ({self.dtype}) or, for "
                             f"a float32 model, torch.bfloat16 or torch.float16; got {dtype!r}")
        return KVCacheSpec(num_layers=self.config.num_layers, n_kv_heads=self.shard.n_kv_heads,
                           head_dim=self.config.head_dim, dtype=dtype, block_size=block_size)

    def forward(self, input_ids: Tensor, step: ops.DecoderStep, kv_cache: PagedKVCache,
                lora: LoRALayers | None = None) -> Tensor:
        """Runs one step over a packed batch and writes its K/V into ``kv_cache``.

        Args:
            input_ids: int64 ``[T]``, every sequence's new tokens back to back.
            step: where the tokens sit in the batch and the cache, their positions included (a
                :class:`fastllm.ops.DecoderStep`, built by the engine's model runner).
            kv_cache: the paged cache the tokens' K/V go into and are read from (post-RoPE
                keys, or pre-RoPE ones rotated as attention reads them: ``kv_cache.pre_rope``).
            lora: LoRA adapter slots (an object whose ``layers`` hold, per layer, the
                :class:`fastllm.ops.ProjectionLoRA` of each projection by the
                :class:`fastllm.ops.DecoderLayer` field's prefix: "qkv", "o", "gate_up",
                "down"), read at the tokens' ``step.lora_slots``; the layers are bound to them
                once, as to the weights.

        Returns:
            ``[T, hidden]`` final-norm hidden states; pass the rows that need logits (usually
            each sequence's last) to :meth:`compute_logits`.
        """
        tp = self.tensor_parallel
        if tp is None:
            # [T, hidden]; an embedding stored in 16 bits (models/build.py) looks up in its dtype.
            x = self.embed_tokens(input_ids).to(self.dtype)
        else:
            # Each rank looks up the tokens in its rows, zeros for the others': the sum over
            # ranks is each token's row, exactly.
            local, here = self._local_vocab(input_ids)
            x = self.embed_tokens(local).to(self.dtype).masked_fill(~here[:, None], 0)
            x = ops.all_reduce(x, tp.group_name)
        if self.config.family.embedding_scale:
            # Gemma: times sqrt(hidden) rounded to the activations' dtype, as HF does.
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        layers = self._bind_layers(lora)
        x, residual = layers(x, None, step, kv_cache.k_cache, kv_cache.v_cache, kv_cache.pre_rope)
        return self.norm(x, residual)[0]

    def _bind_layers(self, lora: LoRALayers | None) -> ops.DecoderLayers:
        """The layers bound to the weights (and ``lora``'s slots), bound at first use."""
        layers = self._bound_layers if lora is None else self._bound_lora_layers.get(lora)
        if layers is not None:
            return layers
        records = [layer.record() for layer in self.layers]
        if lora is not None:
            records = [record.replace(**{f"{name}_lora": slots
                                         for name, slots in adapters.items()})
                       for record, adapters in zip(records, lora.layers, strict=True)]
        tp = self.tensor_parallel
        layers = ops.DecoderLayers(records, self.rope_tables(),
                                   None if tp is None else tp.group_name)
        if lora is None:
            self._bound_layers = layers
        else:
            self._bound_lora_layers[lora] = layers
        return layers

    def compute_logits(self, hidden: Tensor, token_ids: Tensor | None = None) -> Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` logits through the (possibly tied) LM head, or
        ``[n, len(token_ids)]``: only those tokens' rows of the head (a scorer that reads two
        logits need not compute 151,936); soft-capped when the model says so. A tensor-parallel rank computes its vocabulary
        rows' logits and gathers the others' (or, for ``token_ids``, sums each rank's share,
        zeros elsewhere): every rank returns them all."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        weight = head.weight
        quantized = isinstance(head, (QuantizedEmbedding, QuantizedLinear))
        weight_type = head.weight_type if quantized else None
        tp = self.tensor_parallel
        if token_ids is not None:
            if tp is not None:
                token_ids, here = self._local_vocab(token_ids)
            # [len(token_ids), hidden], a small copy
            weight, weight_type = (ops.quantized_rows(weight, weight_type, token_ids) if quantized
                                   else (weight[token_ids], None))
        if quantized:
            logits = ops.quantized_linear(hidden, weight, weight_type)
        else:
            logits = ops.linear(hidden, weight)
        cap = self.config.final_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap), as HF computes it
            logits = torch.tanh(logits / cap) * cap
        if tp is None:
            return logits
        if token_ids is not None:
            return ops.all_reduce(logits.masked_fill(~here, 0), tp.group_name)
        n, rows = logits.shape  # [n, vocab_rows]: this rank's rows, padding included
        gathered = ops.all_gather(logits, tp.size, tp.group_name)  # [size * n, vocab_rows]
        full = gathered.view(tp.size, n, rows).transpose(0, 1).reshape(n, tp.size * rows)
        return full[:, :self.config.vocab_size].contiguous()  # the padding rows' cut off

    def _local_vocab(self, token_ids: Tensor) -> tuple[Tensor, Tensor]:
        """``(rows, here)``: each token's row in this rank's vocabulary shard (0 where it is
        not here) and whether it is here, without a host sync."""
        local = token_ids - self.shard.vocab_start
        here = (local >= 0) & (local < self.shard.vocab_rows)
        return local.masked_fill(~here, 0), here
