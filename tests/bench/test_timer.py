"""The shared benchmark timer, on a fake clock: statistics, interleaving, budget."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from fastllm.bench.timer import TimerConfig, compare, summarize


class FakeClock:
    """A clock that advances only when a fake competitor 'runs'; logs who ran."""

    def __init__(self) -> None:
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def competitor(self, name: str, durations: list[float]) -> Callable[[], None]:
        """A function whose n-th call lasts ``durations[n]`` (the last one thereafter)."""
        remaining = list(durations)

        def run() -> None:
            self.calls.append(name)
            self.now += remaining.pop(0) if len(remaining) > 1 else remaining[0]

        return run


def test_summarize_median_quartiles_min() -> None:
    timing = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (timing.median_s, timing.p25_s, timing.p75_s, timing.min_s, timing.repeats) == (
        3.0, 2.0, 4.0, 1.0, 5)
    assert summarize([2.0, 4.0]).median_s == 3.0
    single = summarize([7.0])
    assert single.p25_s == single.median_s == single.p75_s == 7.0


def test_compare_times_each_call_and_interleaves() -> None:
    clock = FakeClock()
    competitors = {"a": clock.competitor("a", [9.0, 9.0, 5.0, 1.0, 3.0, 2.0, 4.0]),
                   "b": clock.competitor("b", [0.5])}
    timings = compare(competitors, TimerConfig(warmup=2, repeats=5, budget_s=100.0),
                      clock=clock)
    assert clock.calls == ["a", "b"] * 7
    assert timings["a"] == summarize([5.0, 1.0, 3.0, 2.0, 4.0])  # warm-up calls dropped
    assert timings["b"].median_s == 0.5 and timings["b"].repeats == 5


def test_budget_limits_slow_competitors_only() -> None:
    clock = FakeClock()
    competitors = {"slow": clock.competitor("slow", [0.6]),
                   "fast": clock.competitor("fast", [0.01])}
    timings = compare(competitors, TimerConfig(warmup=1, repeats=10, budget_s=1.0), clock=clock)
    assert timings["slow"].repeats == 2  # 0.6 s spent < 1 s budget, then 1.2 s: stop
    assert timings["fast"].repeats == 10
    assert clock.calls[:6] == ["slow", "fast"] * 3  # interleaved while both run


def test_warmup_call_past_budget_is_the_measurement() -> None:
    clock = FakeClock()
    timings = compare({"huge": clock.competitor("huge", [3.0])},
                      TimerConfig(warmup=2, repeats=10, budget_s=1.0), clock=clock)
    assert clock.calls == ["huge"]
    assert timings["huge"].median_s == 3.0 and timings["huge"].repeats == 1


def test_min_repeats_beats_budget() -> None:
    clock = FakeClock()
    timings = compare({"huge": clock.competitor("huge", [3.0])},
                      TimerConfig(warmup=0, repeats=10, budget_s=1.0, min_repeats=3),
                      clock=clock)
    assert timings["huge"].repeats == 3


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        TimerConfig(repeats=0)
    with pytest.raises(ValueError):
        TimerConfig(repeats=2, min_repeats=3)
