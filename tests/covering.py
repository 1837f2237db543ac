"""Covering arrays for the op grids: instead of every combination of a test's parameters, rows in
which every pair of values of any two parameters appears at least once (pairwise), plus the rows
a grid always keeps (its edge cases: the awkward sizes, a kernel's switch points). A fault that
needs one parameter's value, or two parameters' values together, shows in some row; the full
product mostly repeats such rows.

``@covering.grid(dtype=DTYPES, rows=[...], edges=[{...}])`` on a test parametrizes it with these
rows (conftest.py's ``pytest_generate_tests``); a test that takes the ``backend`` fixture has the
backend as one more parameter of the array, and an edge row may name it. The rows are the same on
every run (no randomness), so test ids and their seeds (conftest's ``_seed``) stay put.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from itertools import combinations
from typing import Any

import pytest

__all__ = ["grid", "pairwise", "row_id"]


def pairwise(parameters: Mapping[str, Sequence[Any]],
             edges: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """Rows (parameter name -> value) covering every pair of values of any two parameters, the
    ``edges`` first: each edge fixes some parameters, and the others are filled in to cover as
    many pairs as they can.

    Greedy (AETG's idea, deterministic): each new row starts from the first pair not yet
    covered and takes, parameter by parameter, the value that covers the most pairs not yet
    covered with the values already chosen; among equals the one in the fewest rows so far, so
    that the values a row takes only to be complete vary too.
    """
    names = list(parameters)
    values = [list(parameters[name]) for name in names]
    for name, options in zip(names, values):
        if not options:
            raise ValueError(f"parameter {name!r} has no values")
    uncovered = {(i, a, j, b) for i, j in combinations(range(len(names)), 2)
                 for a in range(len(values[i])) for b in range(len(values[j]))}
    rows: list[list[int]] = []
    uses = [[0] * len(options) for options in values]

    def gain(i: int, a: int, chosen: dict[int, int]) -> int:
        return sum((min(i, j), a if i < j else b, max(i, j), b if i < j else a) in uncovered
                   for j, b in chosen.items())

    def complete(chosen: dict[int, int]) -> list[int]:
        for i in range(len(names)):
            if i not in chosen:
                chosen[i] = max(range(len(values[i])),
                                key=lambda a: (gain(i, a, chosen), -uses[i][a], -a))
        return [chosen[i] for i in range(len(names))]

    def add(row: list[int]) -> None:
        if row not in rows:
            rows.append(row)
            for i, a in enumerate(row):
                uses[i][a] += 1
        uncovered.difference_update((i, row[i], j, row[j])
                                    for i, j in combinations(range(len(names)), 2))

    for edge in edges:
        unknown = set(edge) - set(names)
        if unknown:
            raise ValueError(f"edge row {edge} names no parameter {sorted(unknown)}")
        add(complete({names.index(name): _index(values[names.index(name)], value, name)
                      for name, value in edge.items()}))
    while uncovered:
        i, a, j, b = min(uncovered)
        add(complete({i: a, j: b}))
    for i, counts in enumerate(uses):  # a grid of one parameter has no pairs
        for a, count in enumerate(counts):
            if not count:
                add(complete({i: a}))
    return [{name: values[i][row[i]] for i, name in enumerate(names)} for row in rows]


def _index(options: list[Any], value: Any, name: str) -> int:
    for k, option in enumerate(options):
        if option is value or option == value:
            return k
    raise ValueError(f"edge value {value!r} is not one of {name!r}'s values {options}")


def row_id(value: Any) -> str:
    """A value's part of a test id: ``float32`` for a dtype, ``64x24`` for a tuple."""
    if isinstance(value, tuple):
        return "x".join(map(row_id, value))
    return str(value).removeprefix("torch.")


def grid(edges: Sequence[Mapping[str, Any]] = (),
         ids: Mapping[str, Callable[[Any], str]] | None = None,
         **parameters: Sequence[Any]) -> pytest.MarkDecorator:
    """Marks a test to run on the pairwise rows of ``parameters`` (one argument of the test
    each) and ``edges``; ``ids`` maps a parameter to how its values read in test ids (default
    :func:`row_id`)."""
    return pytest.mark.covering(parameters=parameters, edges=list(edges), ids=dict(ids or {}))
