"""Runs within a size budget: in order, each at most the budget unless one item alone exceeds it."""

from szformat._runs import runs_within


def test_runs_fill_up_to_the_budget_in_order():
    assert runs_within([3, 4, 3, 1, 5, 2], lambda x: x, 7) == [[3, 4], [3, 1], [5, 2]]


def test_an_item_over_the_budget_is_a_run_of_its_own_and_nothing_gives_no_runs():
    assert runs_within([2, 9, 0, 1], lambda x: x, 4) == [[2], [9], [0, 1]]
    assert runs_within([9], lambda x: x, 4) == [[9]]
    assert runs_within([], lambda x: x, 4) == []
    assert runs_within(["a", "bb"], len, 0) == [["a"], ["bb"]]
