"""The store's writes made once per branch (actors.groups.store.StoreSteps): a branch that
runs again (its worker was lost) gets each write's first answer back; one that writes
something else at the same step is not deterministic, and is told so by name."""

from __future__ import annotations

import pytest

from actors.errors import GroupError
from actors.groups import Store, parallel, run_group
from actors.groups.store import BranchStore, StoreSteps


def test_a_branch_running_again_gets_its_first_answers_and_writes_nothing_twice():
    store, steps = Store({"n": 0}), StoreSteps()
    first = BranchStore(store, steps, "", 3)
    assert [first.incr("n"), first.incr("n", 5)] == [1, 6]
    first.set("k", "v1")
    BranchStore(store, steps, "", 4).incr("n")   # another branch, between the two runs
    again = BranchStore(store, steps, "", 3)
    assert [again.incr("n"), again.incr("n", 5)] == [1, 6]
    again.set("k", "v1")
    assert again.update("u", lambda v: (v or 0) + 1) == 1   # a write the first run never made
    assert store.snapshot() == {"n": 7, "k": "v1", "u": 1} and steps.repeated == 3


def test_the_same_branch_index_in_a_nested_scope_is_another_branch():
    store, steps = Store(), StoreSteps()
    BranchStore(store, steps, "", 0).incr("n")
    BranchStore(store, steps, "0.1/", 0).incr("n")
    assert store.get("n") == 2 and steps.repeated == 0


def test_a_branch_writing_another_key_when_it_runs_again_is_refused_as_not_deterministic():
    store, steps = Store(), StoreSteps()
    BranchStore(store, steps, "1.1/", 2).incr("a")
    with pytest.raises(GroupError, match=r"branch 2 of the nested group at '1.1/' is not "
                                         r"deterministic.*incr\('b'\).*incr\('a'\)"):
        BranchStore(store, steps, "1.1/", 2).incr("b")
    assert store.snapshot() == {"a": 1}


def test_update_runs_its_function_once_for_a_branch():
    store, steps = Store(), StoreSteps()
    calls = []

    def bump(v):
        calls.append(v)
        return (v or 0) + 10

    assert BranchStore(store, steps, "", 0).update("x", bump) == 10
    assert BranchStore(store, steps, "", 0).update("x", bump) == 10
    assert calls == [None] and store.get("x") == 10


def test_a_group_on_threads_alone_counts_every_write_and_numbers_none():
    def count(word: str, ctx) -> int:
        for _ in range(10):
            ctx.store.incr("words")
        return len(word)

    out = run_group(count, ["a", "bb"] * 20, max_concurrency=4, max_items=40)
    assert out.store == {"words": 400} and out.results[:2] == [1, 2]
    assert "remote" not in out.stats   # no record kept (Fleet.open makes one)


def _inner(x: int, ctx) -> int:
    ctx.store.incr("inner")
    return x


def _outer_plain(x: int, ctx) -> int:
    ctx.store.incr("outer")
    return sum(parallel(_inner, [x, x], max_concurrency=2, max_items=2))   # not ctx.parallel


def _outer_ctx(x: int, ctx) -> int:
    ctx.store.incr("outer")
    return sum(ctx.parallel(_inner, [x, x], max_concurrency=2, max_items=2))


@pytest.mark.parametrize("outer", [_outer_plain, _outer_ctx], ids=["parallel", "ctx.parallel"])
def test_a_nested_groups_writes_on_threads_count_apart_from_its_parents(outer):
    out = run_group(outer, [1, 2, 3], max_concurrency=3, max_items=3)
    assert out.status == "completed", out.error
    assert out.store == {"outer": 3, "inner": 6}
