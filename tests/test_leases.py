"""The one lease table (actors/machines/leases.py) against a plain-dict model, driven by
hypothesis: workers join, rejoin with other slots, reconnect listing what they still hold,
leave and are presumed lost (and come back); leases are added, given, revoked, answered
(and answered again, late), taken back and dropped. After every step: a lease is waiting
or held by exactly one live worker, never both; every worker it went to may answer it;
no worker holds more than its capacity; a lease lost ``MAX_TRIES`` times is given up;
nothing is lost; nothing is answered twice."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actors.machines.leases import LeaseTable

NAMES = ["a", "b", "c"]
MAX_TRIES = 2


class Table(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t: LeaseTable[int] = LeaseTable(max_tries=MAX_TRIES)
        self.n = 0
        self.model_holder: dict[str, str | None] = {}   # live lease -> holder (None: waiting)
        self.model_given: dict[str, set[str]] = {}      # live lease -> every worker it went to
        self.model_tries: dict[str, int] = {}
        self.lost: set[str] = set()
        self.capacity: dict[str, int] = {}
        self.answered: list[str] = []
        self.gone: set[str] = set()

    @rule(name=st.sampled_from(NAMES), slots=st.integers(1, 3), queued=st.integers(0, 2))
    def join(self, name, slots, queued):
        held = [l for l, h in self.model_holder.items() if h == name]
        order = list(self.t.workers[name].held) if name in self.t.workers else []
        if self.t.back(name) is not None:   # presumed lost, heard from again: it joins
            self.lost.discard(name)
        back = self.t.join(name, slots, queued)
        self.capacity[name] = slots + queued
        assert back == order[slots + queued:] and len(held) == len(order)
        for lid in back:
            self.model_holder[lid] = None

    @rule(name=st.sampled_from(NAMES))
    def leave(self, name):
        back = self.t.leave(name)
        expected = [lid for lid, h in self.model_holder.items() if h == name]
        assert sorted(back) == sorted(expected)
        for lid in back:
            self.model_holder[lid] = None
        self.capacity.pop(name, None)

    @rule()
    def add(self):
        lid = f"L{self.n}"
        self.n += 1
        self.t.add(lid, self.n)
        self.model_holder[lid] = None

    @precondition(lambda self: any(h is None for h in self.model_holder.values())
                  and self.capacity)
    @rule(data=st.data())
    def give(self, data):
        lid = data.draw(st.sampled_from(sorted(l for l, h in self.model_holder.items()
                                               if h is None)))
        name = data.draw(st.sampled_from(sorted(self.capacity)))
        held = sum(1 for h in self.model_holder.values() if h == name)
        if held >= self.capacity[name]:
            with pytest.raises(ValueError, match="capacity"):
                self.t.give(lid, name)
            return
        self.t.give(lid, name)
        self.model_holder[lid] = name
        self.model_given.setdefault(lid, set()).add(name)

    @precondition(lambda self: bool(self.model_holder))
    @rule(data=st.data())
    def answer(self, data):
        lid = data.draw(st.sampled_from(sorted(self.model_holder)))
        assert all(self.t.may_answer(lid, w) for w in self.model_given.get(lid, ()))
        assert self.t.answer(lid) is not None
        del self.model_holder[lid]
        self.model_given.pop(lid, None)
        self.model_tries.pop(lid, None)
        self.answered.append(lid)
        self.gone.add(lid)

    @precondition(lambda self: bool(self.gone))
    @rule(data=st.data())
    def late_answer_is_dropped_and_counted(self, data):
        lid = data.draw(st.sampled_from(sorted(self.gone)))
        before = self.t.late
        assert self.t.answer(lid) is None
        assert self.t.late == before + 1

    @precondition(lambda self: any(h is not None for h in self.model_holder.values()))
    @rule(data=st.data())
    def take_back(self, data):
        lid = data.draw(st.sampled_from(sorted(l for l, h in self.model_holder.items()
                                               if h is not None)))
        assert self.t.take_back(lid)
        self.model_holder[lid] = None

    @precondition(lambda self: bool(self.model_holder))
    @rule(data=st.data())
    def drop(self, data):
        lid = data.draw(st.sampled_from(sorted(self.model_holder)))
        assert self.t.drop(lid) is not None
        del self.model_holder[lid]
        self.model_given.pop(lid, None)
        self.model_tries.pop(lid, None)
        self.gone.add(lid)

    @rule(name=st.sampled_from(NAMES))
    def a_worker_is_presumed_lost(self, name):
        expected = [lid for lid, h in self.model_holder.items() if h == name]
        order = list(self.t.workers[name].held) if name in self.t.workers else []
        again, given_up = self.t.lose(name)
        assert sorted(again + given_up) == sorted(expected)
        assert [lid for lid in order if lid in set(again)] == again   # in the order given
        for lid in expected:
            self.model_holder[lid] = None
            self.model_tries[lid] = self.model_tries.get(lid, 0) + 1
            assert (lid in given_up) == (self.model_tries[lid] >= MAX_TRIES)
            if lid in given_up:
                del self.model_tries[lid]
        if name in self.capacity:
            self.lost.add(name)
        self.capacity.pop(name, None)

    @precondition(lambda self: any(h is not None for h in self.model_holder.values()))
    @rule(data=st.data())
    def a_worker_reconnects_listing_some_of_its_leases(self, data):
        name = data.draw(st.sampled_from(sorted({h for h in self.model_holder.values()
                                                 if h is not None})))
        held = list(self.t.workers[name].held)
        keep = data.draw(st.lists(st.sampled_from(held), unique=True))
        worker = self.t.workers[name]
        back = self.t.reconnect(name, worker.slots, keep)
        assert set(back) == set(held) - set(keep)
        for lid in back:
            self.model_holder[lid] = None

    @precondition(lambda self: any(h is not None for h in self.model_holder.values()))
    @rule(data=st.data())
    def revoke(self, data):
        lid = data.draw(st.sampled_from(sorted(l for l, h in self.model_holder.items()
                                               if h is not None)))
        assert self.t.revoke(lid) == self.model_holder[lid] and lid in self.t.revoking

    @invariant()
    def the_table_is_the_model(self):
        assert set(self.t.payload) == set(self.model_holder)
        assert self.t.holder == {l: h for l, h in self.model_holder.items() if h is not None}
        for name, worker in self.t.workers.items():
            assert len(worker.held) <= worker.capacity == self.capacity[name]
            assert sorted(worker.held) == sorted(l for l, h in self.model_holder.items()
                                                 if h == name)
        assert self.t.running == sum(min(len(w.held), w.slots)
                                     for w in self.t.workers.values())
        assert set(self.t.lost) == self.lost and not self.lost & set(self.t.workers)
        assert self.t.revoking <= set(self.t.holder)
        assert self.t.tries == {l: n for l, n in self.model_tries.items()
                                if l in self.model_holder}

    @invariant()
    def nothing_is_answered_twice(self):
        assert len(self.answered) == len(set(self.answered))


Table.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                   derandomize=True)
test_the_lease_table_matches_its_model = Table.TestCase


def test_lease_ids_are_never_reused_and_only_waiting_leases_are_given():
    t: LeaseTable[str] = LeaseTable()
    t.join("w", slots=1, queued=1)
    t.add("x", "payload")
    with pytest.raises(ValueError, match="never reused"):
        t.add("x", "again")
    t.give("x", "w")
    with pytest.raises(ValueError, match="not waiting"):
        t.give("x", "w")
    with pytest.raises(ValueError, match="not a registered worker"):
        t.add("y", "p") or t.give("y", "nobody")
    assert t.free_slots("w") == 0 and t.room("w") == 1
    assert t.answer("x") == "payload" and t.answer("x") is None and t.late == 1
