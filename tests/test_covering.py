"""tests/covering.py, which the op grids are built with: every pair of values of any two
parameters is in some row, every edge row is in as given, the rows stay few and the same from run
to run."""

from itertools import combinations, product

import pytest
from covering import pairwise, row_id

GRIDS = {
    "linear": {"backend": ["cpu", "composite", "cuda_sim", "cuda"],
               "dtype": ["float32", "bfloat16", "float16"],
               "rows": [0, 1, 2, 3, 4, 5, 7, 8, 9, 13, 64, 65],
               "shape": [(64, 24), (1, 9), (7, 3), (33, 17), (1029, 70)],
               "bias": [False, True]},
    "one_parameter": {"dtype": ["float32", "bfloat16"]},
    "a_single_value": {"a": [1], "b": [1, 2, 3], "c": ["x", "y"]},
    "many_binary": {name: [False, True] for name in "abcdefghij"},
}
EDGES = [{"backend": "cpu", "dtype": "float32", "rows": 64},
         {"backend": "cpu", "dtype": "bfloat16", "rows": 9, "shape": (1029, 70)},
         {"bias": True}]


def pairs_of(row: dict) -> set:
    return {((a, row[a]), (b, row[b])) for a, b in combinations(row, 2)}


@pytest.mark.parametrize("name", GRIDS)
def test_every_pair_is_in_some_row(name):
    grid = GRIDS[name]
    rows = pairwise(grid)
    assert all(set(row) == set(grid) for row in rows)
    covered = set().union(*map(pairs_of, rows))
    wanted = {((a, x), (b, y)) for a, b in combinations(grid, 2)
              for x, y in product(grid[a], grid[b])}
    assert covered == wanted
    if len(grid) == 1:
        assert rows == [{"dtype": "float32"}, {"dtype": "bfloat16"}]


def test_edges_come_first_as_given_and_pairs_still_all_covered():
    grid = GRIDS["linear"]
    rows = pairwise(grid, EDGES)
    for edge, row in zip(EDGES, rows):
        assert {name: row[name] for name in edge} == edge
    covered = set().union(*map(pairs_of, rows))
    assert all(pairs_of(row) <= covered for row in map(dict, product(
        *[[(name, value) for value in values] for name, values in grid.items()])))


def test_rows_are_few_and_the_same_every_time():
    grid = GRIDS["linear"]
    rows = pairwise(grid, EDGES)
    # At least 12 x 5 (rows x shapes), against 1,440 in the full product.
    assert 60 <= len(rows) <= 70
    assert len({tuple(row.values()) for row in rows}) == len(rows)
    assert pairwise(grid, EDGES) == rows
    # 2^10 combinations, 45 pairs of parameters: a handful of rows covers them.
    assert len(pairwise(GRIDS["many_binary"])) <= 10


def test_bad_grids_and_edges_are_refused():
    with pytest.raises(ValueError, match="parameter 'rows' has no values"):
        pairwise({"dtype": ["float32"], "rows": []})
    with pytest.raises(ValueError, match=r"edge row \{'head_dim': 64\} names no parameter "
                                         r"\['head_dim'\]"):
        pairwise(GRIDS["linear"], [{"head_dim": 64}])
    with pytest.raises(ValueError, match="edge value 66 is not one of 'rows'"):
        pairwise(GRIDS["linear"], [{"rows": 66}])


def test_row_ids():
    import torch

    assert [row_id(v) for v in (torch.bfloat16, (1029, 70), 3, "cpu", True)] == [
        "bfloat16", "1029x70", "3", "cpu", "True"]
