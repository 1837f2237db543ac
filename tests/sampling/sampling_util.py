"""Helpers shared by the sampler tests: per-row parameter tensors, random logits kept away from
the filters' thresholds, and a chi-square test."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Row:
    """The sampling controls of one row."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    offset: int = 0

    def filters(self) -> tuple[float, int, float, float]:
        """The arguments of reference.filtered_probs after the logits."""
        return self.temperature, self.top_k, self.top_p, self.min_p


def row_args(rows: list[Row], device="cpu") -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p, seeds, offsets) tensors, the ops' argument order."""

    def column(name, dtype):
        return torch.tensor([getattr(r, name) for r in rows], dtype=dtype, device=device)

    return (column("temperature", torch.float32), column("top_k", torch.int32),
            column("top_p", torch.float32), column("min_p", torch.float32),
            column("seed", torch.int64), column("offset", torch.int64))


def repeated_args(row: Row, n: int, device="cpu") -> tuple[torch.Tensor, ...]:
    """The arguments of ``n`` copies of ``row`` drawing at offsets ``row.offset + 0 .. n-1``."""
    temperature, top_k, top_p, min_p, seeds, _ = row_args([row], device)
    offsets = row.offset + torch.arange(n, dtype=torch.int64, device=device)
    return (temperature.expand(n).contiguous(), top_k.expand(n).contiguous(),
            top_p.expand(n).contiguous(), min_p.expand(n).contiguous(),
            seeds.expand(n).contiguous(), offsets)


def random_logits(vocab: int, *, scale: float = 1.5, n_inf: int | None = None,
                  tie_top: bool = True, n_ties: int = 2) -> torch.Tensor:
    """float32 ``[vocab]``: ``scale * randn`` with ``n_inf`` entries at -inf (default vocab // 10,
    at least 1 when vocab >= 4), the maximum duplicated once (a tie at the top) and ``n_ties``
    other values duplicated (ties inside the distribution)."""
    x = torch.randn(vocab) * scale
    perm = torch.randperm(vocab).tolist()
    if tie_top and vocab >= 2:
        x[perm.pop()] = x.max()
    for _ in range(n_ties):
        if len(perm) >= 2:
            x[perm.pop()] = x[perm.pop()]
    if n_inf is None:
        n_inf = vocab // 10 if vocab >= 10 else int(vocab >= 4)
    for _ in range(min(n_inf, len(perm))):
        x[perm.pop()] = -math.inf
    return x


def threshold_margin(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                     min_p: float) -> float:
    """How far (float64) the row is from flipping a top-p or min-p decision: the smallest
    ``|mass above a token - top_p|`` and ``|x - (max x + log min_p)|`` over the tokens."""
    if temperature == 0:
        return math.inf
    x = logits.double().cpu() / temperature
    vocab = x.numel()
    margin = math.inf
    if 0 < top_k < vocab:
        x = x.masked_fill(x < x.topk(top_k).values[-1], -math.inf)
    if top_p < 1:
        probs = x.softmax(-1)
        sorted_probs = probs[probs > 0].sort(descending=True).values
        exclusive = sorted_probs.cumsum(0) - sorted_probs
        # A tie group's tokens all have the mass above the group's first member.
        first_of_tie = torch.searchsorted(-sorted_probs, -sorted_probs, side="left")
        mass_above = exclusive[first_of_tie]
        margin = min(margin, (mass_above - top_p).abs().min().item())
    if min_p > 0:
        finite = x > -math.inf
        margin = min(margin, (x[finite] - (x.max() + math.log(min_p))).abs().min().item())
    return margin


def conditioned_logits(make, row: Row, margin: float = 1e-4, tries: int = 200) -> torch.Tensor:
    """``make()`` again until its logits are at least ``margin`` from every threshold of ``row``,
    so that float32 kernels and the float64 reference filter the same tokens."""
    for _ in range(tries):
        logits = make()
        if threshold_margin(logits, *row.filters()) > margin:
            return logits
    raise AssertionError(f"no well-conditioned logits for {row} in {tries} tries")


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's goodness-of-fit test of ``counts`` (int ``[vocab]``) against ``probs``.

    Bins with an expected count below 5 are merged, smallest first, until each merged bin
    expects at least 5. Returns ``(p_value, degrees of freedom, statistic)``; ``p_value`` is the
    upper tail of the chi-square distribution, ``Q(df / 2, stat / 2)``.
    """
    n = int(counts.sum())
    expected = probs.double().cpu() * n
    observed = counts.double().cpu()
    support = expected > 0
    expected, observed = expected[support], observed[support]
    bins_e, bins_o = [], []
    acc_e = acc_o = 0.0
    for i in expected.argsort().tolist():  # ascending: the small bins merge with each other
        acc_e += expected[i].item()
        acc_o += observed[i].item()
        if acc_e >= 5:
            bins_e.append(acc_e)
            bins_o.append(acc_o)
            acc_e = acc_o = 0.0
    if acc_e > 0:  # leftovers (only when everything together expects < 5 more)
        if bins_e:
            bins_e[-1] += acc_e
            bins_o[-1] += acc_o
        else:
            bins_e.append(acc_e)
            bins_o.append(acc_o)
    df = len(bins_e) - 1
    if df == 0:
        return 1.0, 0, 0.0
    e, o = torch.tensor(bins_e, dtype=torch.float64), torch.tensor(bins_o, dtype=torch.float64)
    stat = ((o - e) ** 2 / e).sum()
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()
    return p, df, stat.item()


