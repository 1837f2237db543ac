"""The one timer every fastllm benchmark uses.

Competitors are timed interleaved (round-robin: A, B, C, A, B, C, ...) in one process, so load
from other work on the machine hits them alike and their ratios stay meaningful even when the
absolute times drift. Each competitor gets warm-up calls, then timed calls until it has
``repeats`` samples or has spent ``budget_s`` seconds (and has at least ``min_repeats``), so a
method that takes a second per call costs a few seconds, not ``repeats`` seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Timing", "TimerConfig", "compare", "summarize"]


@dataclass(frozen=True)
class Timing:
    """Summary of one competitor's timed calls, in seconds."""

    median_s: float
    p25_s: float
    p75_s: float
    min_s: float
    repeats: int

    def to_dict(self) -> dict[str, float | int]:
        """Milliseconds, as benchmark rows store them."""
        return {
            "median_ms": self.median_s * 1e3,
            "p25_ms": self.p25_s * 1e3,
            "p75_ms": self.p75_s * 1e3,
            "min_ms": self.min_s * 1e3,
            "repeats": self.repeats,
        }


@dataclass(frozen=True)
class TimerConfig:
    """How long to time each competitor.

    Attributes:
        warmup: untimed calls before the timed ones. A warm-up call that alone lasts
            ``budget_s`` or longer ends the warm-up and is kept as the first sample: one-time
            costs (allocation, thread start-up) are negligible against a call that long, and
            calling it again only to discard it would double the cost of the slowest cases.
        repeats: most timed calls per competitor.
        budget_s: timed seconds after which a competitor stops (once it has ``min_repeats``).
        min_repeats: fewest timed calls per competitor, whatever the budget.
    """

    warmup: int = 2
    repeats: int = 20
    budget_s: float = 1.0
    min_repeats: int = 1

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.repeats < 1 or not 1 <= self.min_repeats <= self.repeats:
            raise ValueError(f"need warmup >= 0 and 1 <= min_repeats <= repeats, got {self}")
        if self.budget_s < 0:
            raise ValueError(f"budget_s must be >= 0, got {self.budget_s}")

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, defaults: TimerConfig) -> None:
        """Adds ``--warmup``, ``--repeats`` and ``--budget`` to a benchmark's command line."""
        parser.add_argument("--warmup", type=int, default=defaults.warmup,
                            help="untimed calls per competitor (default %(default)s)")
        parser.add_argument("--repeats", type=int, default=defaults.repeats,
                            help="most timed calls per competitor (default %(default)s)")
        parser.add_argument("--budget", type=float, default=defaults.budget_s,
                            help="timed seconds per competitor and measurement, after which it "
                                 "stops repeating (default %(default)s)")

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> TimerConfig:
        """The config given by the options :meth:`add_arguments` added."""
        return cls(warmup=args.warmup, repeats=args.repeats, budget_s=args.budget)


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the work queued on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "mps":
        return torch.mps.synchronize
    return lambda: None


def summarize(samples: Sequence[float]) -> Timing:
    """Median, quartiles (linear interpolation between samples) and minimum of ``samples``."""
    if not samples:
        raise ValueError("need at least one sample")
    if len(samples) == 1:
        p25, p75 = samples[0], samples[0]
    else:
        p25, _, p75 = statistics.quantiles(samples, n=4, method="inclusive")
    return Timing(median_s=statistics.median(samples), p25_s=p25, p75_s=p75,
                  min_s=min(samples), repeats=len(samples))


def compare(
    competitors: Mapping[str, Callable[[], object]],
    config: TimerConfig,
    *,
    device: torch.device | str = "cpu",
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """Times ``competitors`` interleaved, round-robin, and summarizes each one's calls.

    Args:
        competitors: name -> function of no arguments doing one call of the work (inputs built
            beforehand, outside the timing).
        config: warm-up, repeats and per-competitor budget.
        device: where the work runs; on a GPU every timed call is bracketed by a synchronize.
        clock: seconds, monotonic (replaceable for tests).

    Returns:
        name -> :class:`Timing`, in the order of ``competitors``.
    """
    sync = _synchronizer(torch.device(device))

    def timed_call(fn: Callable[[], object]) -> float:
        sync()
        start = clock()
        fn()
        sync()
        return clock() - start

    samples: dict[str, list[float]] = {name: [] for name in competitors}
    warming = list(competitors)
    for _ in range(config.warmup):
        for name in list(warming):
            elapsed = timed_call(competitors[name])
            if elapsed >= config.budget_s:  # long enough to be its own measurement
                samples[name].append(elapsed)
                warming.remove(name)

    def wants_more(name: str) -> bool:
        taken = samples[name]
        if len(taken) >= config.repeats:
            return False
        return len(taken) < config.min_repeats or sum(taken) < config.budget_s

    active = [name for name in competitors if wants_more(name)]
    while active:
        for name in active:
            samples[name].append(timed_call(competitors[name]))
        active = [name for name in active if wants_more(name)]
    return {name: summarize(taken) for name, taken in samples.items()}
