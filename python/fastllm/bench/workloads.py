"""Model-shaped inputs and models shared by the benchmarks (random values: only speed matters)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch
from torch import Tensor

from fastllm.bench.timer import TimerConfig, Timing
from fastllm.models import DecoderLM, ModelConfig

__all__ = ["MODEL_SHAPES", "AttentionInputs", "AttentionShape", "DeviceCopy", "DeviceRead",
           "add_shape_arguments", "make_attention_inputs", "parse_device",
           "parse_model_bench_args", "random_model", "repeat_kv"]


@dataclass(frozen=True)
class AttentionShape:
    """The attention geometry of one model family member, and what else its whole model needs
    (:func:`random_model`)."""

    name: str
    hidden_size: int
    num_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    architecture: str
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads


MODEL_SHAPES: dict[str, AttentionShape] = {
    shape.name: shape
    for shape in (
        AttentionShape("qwen3-0.6b", hidden_size=1024, num_layers=28, n_heads=16, n_kv_heads=8,
                       head_dim=128, rope_theta=1_000_000.0, architecture="Qwen3ForCausalLM",
                       intermediate_size=3072, vocab_size=151_936, tie_word_embeddings=True),
        AttentionShape("llama-3-8b", hidden_size=4096, num_layers=32, n_heads=32, n_kv_heads=8,
                       head_dim=128, rope_theta=500_000.0, architecture="LlamaForCausalLM",
                       intermediate_size=14_336, vocab_size=128_256, tie_word_embeddings=False),
    )
}


@dataclass(frozen=True)
class AttentionInputs:
    """One batch of equal-length sequences in both layouts.

    The packed tensors are what :func:`fastllm.ops.attention` takes; the ``*_bhld`` ones are
    ``[batch, heads, len, head_dim]`` views of the same storage, as SDPA takes them.
    """

    q: Tensor  # [batch * len_q, n_heads, head_dim]
    k: Tensor  # [batch * len_k, n_kv_heads, head_dim]
    v: Tensor  # [batch * len_k, n_kv_heads, head_dim]
    cu_seqlens_q: Tensor  # int32 [batch + 1]
    cu_seqlens_k: Tensor  # int32 [batch + 1]
    len_q: int
    len_k: int

    @property
    def batch(self) -> int:
        """Sequences in the batch."""
        return self.cu_seqlens_q.numel() - 1

    def _bhld(self, packed: Tensor, length: int) -> Tensor:
        return packed.view(self.batch, length, *packed.shape[1:]).transpose(1, 2)

    @property
    def q_bhld(self) -> Tensor:
        """``[batch, n_heads, len_q, head_dim]`` view of ``q``."""
        return self._bhld(self.q, self.len_q)

    @property
    def k_bhld(self) -> Tensor:
        """``[batch, n_kv_heads, len_k, head_dim]`` view of ``k``."""
        return self._bhld(self.k, self.len_k)

    @property
    def v_bhld(self) -> Tensor:
        """``[batch, n_kv_heads, len_k, head_dim]`` view of ``v``."""
        return self._bhld(self.v, self.len_k)

    @property
    def io_bytes(self) -> int:
        """Bytes one attention call moves at the least: q, k and v read once, the output (q's
        size) written."""
        return 2 * self.q.nbytes + self.k.nbytes + self.v.nbytes


def make_attention_inputs(shape: AttentionShape, *, batch: int, len_q: int, len_k: int,
                          dtype: torch.dtype, device: torch.device | str) -> AttentionInputs:
    """Random q/k/v for ``batch`` sequences of ``len_q`` queries and ``len_k`` keys each."""
    def randn(tokens: int, heads: int) -> Tensor:
        return torch.randn(tokens, heads, shape.head_dim, dtype=dtype, device=device)

    def cu_seqlens(length: int) -> Tensor:
        return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)

    return AttentionInputs(
        q=randn(batch * len_q, shape.n_heads),
        k=randn(batch * len_k, shape.n_kv_heads),
        v=randn(batch * len_k, shape.n_kv_heads),
        cu_seqlens_q=cu_seqlens(len_q),
        cu_seqlens_k=cu_seqlens(len_k),
        len_q=len_q,
        len_k=len_k,
    )


@dataclass(frozen=True)
class DeviceCopy:
    """``dst.copy_(src)`` on one large float32 buffer: the device's attainable memory bandwidth,
    the peer of memory-bound kernels, timed in the same rounds as they are."""

    src: Tensor
    dst: Tensor

    @classmethod
    def of_mib(cls, mib: int, device: torch.device | str) -> DeviceCopy:
        """A copy of ``mib`` MiB. Both buffers are written first, so no read hits untouched
        (zero-mapped) pages and no write faults a page in: a first copy into fresh pages is
        far slower, can outlast a timer's budget and then be its one sample."""
        src = torch.ones(mib << 18, dtype=torch.float32, device=device)  # 4 bytes each
        return cls(src, torch.zeros_like(src))

    def __call__(self) -> Tensor:
        """One copy: the timed call."""
        return self.dst.copy_(self.src)

    def gbps(self, timing: Timing) -> float:
        """GB/s of a copy lasting ``timing``'s median, counting bytes read plus bytes written."""
        return 2 * self.src.nbytes / timing.median_s / 1e9


@dataclass(frozen=True)
class DeviceRead:
    """``src.sum()`` over one large float32 buffer: the device's attainable read bandwidth,
    the limit of a decode step, which reads its weights and writes almost nothing."""

    src: Tensor

    @classmethod
    def of_mib(cls, mib: int, device: torch.device | str) -> DeviceRead:
        """A read of ``mib`` MiB, written first so that no read hits untouched pages."""
        return cls(torch.ones(mib << 18, dtype=torch.float32, device=device))

    def __call__(self) -> Tensor:
        """One read: the timed call."""
        return self.src.sum()

    def gbps(self, timing: Timing) -> float:
        """GB/s of a read lasting ``timing``'s median."""
        return self.src.nbytes / timing.median_s / 1e9


def parse_device(argv: list[str] | None) -> str:
    """The ``--device`` option of a benchmark's command line (default ``cpu``), read before the
    other options: their defaults depend on it."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--device", default="cpu")
    return parser.parse_known_args(argv)[0].device


def random_model(shape: AttentionShape, *, num_layers: int | None = None,
                 max_position: int = 8192, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0) -> DecoderLM:
    """A :class:`~fastllm.models.DecoderLM` of the shape's dimensions with random weights
    (``num_layers`` of them, default the model's own count): the real model's cost per layer."""
    layers = shape.num_layers if num_layers is None else num_layers
    config = ModelConfig(
        architecture=shape.architecture, vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_layers=layers, sliding_layers=(False,) * layers, rope_layers=(True,) * layers,
        n_heads=shape.n_heads, n_kv_heads=shape.n_kv_heads, head_dim=shape.head_dim,
        rms_norm_eps=1e-6, rope_theta=shape.rope_theta, max_position_embeddings=max_position,
        tie_word_embeddings=shape.tie_word_embeddings)
    torch.manual_seed(seed)
    model = DecoderLM(config)
    for param in model.parameters():  # small weights keep activations in range over the layers
        param.normal_(0.0, 0.02)
    return model.to(dtype=dtype, device=device)


def repeat_kv(x: Tensor, group: int) -> Tensor:
    """HF transformers' ``repeat_kv``: ``[B, Hkv, L, D]`` -> ``[B, Hkv * group, L, D]``, a copy
    with every KV head repeated for the ``group`` query heads that read it."""
    batch, n_kv_heads, length, head_dim = x.shape
    if group == 1:
        return x
    expanded = x[:, :, None].expand(batch, n_kv_heads, group, length, head_dim)
    return expanded.reshape(batch, n_kv_heads * group, length, head_dim)


def add_shape_arguments(parser: argparse.ArgumentParser, *, benchmark: str,
                        models: tuple[str, ...], dtypes: tuple[str, ...]) -> None:
    """Adds the ``--out``, ``--models`` and ``--dtypes`` options of model-shaped benchmarks."""
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help=f"folder for {benchmark}.json and {benchmark}.md "
                             "(default %(default)s)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODEL_SHAPES),
                        default=list(models), help="default %(default)s")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"],
                        default=list(dtypes), help="default %(default)s")


def parse_model_bench_args(argv: list[str] | None, defaults: Any, *, benchmark: str,
                           description: str, sizes: tuple[str, ...],
                           models_dir_help: str,
                           choice_lists: Mapping[str, tuple[str, ...]] | None = None
                           ) -> tuple[Any, Path]:
    """Parses the options of an end-to-end benchmark on a random-weight model: ``--out``,
    ``--dtypes``, an int option per name in ``sizes`` (``--hidden-size`` for ``hidden_size``),
    a list option per name in ``choice_lists`` (its values some of the choices given),
    ``--device``, ``--models-dir`` and the timer's; returns its config dataclass (of
    ``defaults``' type, the defaults where no option is given) and the output folder."""
    choice_lists = choice_lists or {}
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help=f"folder for {benchmark}.json and {benchmark}.md "
                             "(default %(default)s)")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"],
                        default=list(defaults.dtypes), help="default %(default)s")
    for name in sizes:
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=getattr(defaults, name), help="default %(default)s")
    for name, choices in choice_lists.items():
        parser.add_argument("--" + name.replace("_", "-"), nargs="+", choices=choices,
                            default=list(getattr(defaults, name)),
                            help=f"of {', '.join(choices)} (default %(default)s)")
    parser.add_argument("--device", default=defaults.device, help="default %(default)s")
    parser.add_argument("--models-dir", type=Path, default=defaults.models_dir,
                        help=f"{models_dir_help} (default %(default)s)")
    TimerConfig.add_arguments(parser, defaults.timer)
    args = parser.parse_args(argv)
    config = type(defaults)(dtypes=tuple(args.dtypes), device=args.device,
                            models_dir=str(args.models_dir),
                            timer=TimerConfig.from_arguments(args),
                            **{name: getattr(args, name) for name in sizes},
                            **{name: tuple(getattr(args, name)) for name in choice_lists})
    return config, args.out

