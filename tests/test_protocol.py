"""Every message survives the codec; the union is closed and typed."""

from __future__ import annotations

import typing

import msgspec
import pytest

import protocol
from protocol import Diff, RolloutResult, RoundRecord, decode, encode
from protocol.messages import Message

DIFF = Diff("w0:k:0", "worker-0", 0, {"billing": "refund, invoice"})
RECORD = RoundRecord(round=1, version=1, committed=True, heldout_reward=0.5, reasons={"conflict": 1})

EXAMPLES = {
    "Start": protocol.Start(run_id="r", seed=3, task_ids=["a", "b"], n_workers=2, rounds=3,
                            held_out_frac=0.4, max_concurrency=2, sections={"k": 0}),
    "Open": protocol.Open(heldout_ids=["a"], initial_state={"k": "v"}),
    "Baseline": protocol.Baseline(version=0, heldout_reward=0.25),
    "Tick": protocol.Tick(elapsed=1.5),
    "Finish": protocol.Finish(stop_reason="rounds", history=[RECORD]),
    "Shutdown": protocol.Shutdown(reason="rounds"),
    "Budget": protocol.Budget(max_calls=300, max_tokens=10_000, max_cost=2.5,
                              prices={"gpt-4o-mini": (0.15, 0.6)}),
    "Halted": protocol.Halted(reason="backend_failing", error="first: ConnectError"),
    "Unhalt": protocol.Unhalt(),
    "Lease": protocol.Lease(lease_id="r0.u1", round=0, unit=1, task_ids=["a"], section=1),
    "LeaseBatch": protocol.LeaseBatch(round=0, leases=[protocol.Lease(lease_id="x", round=0)],
                                      report_each=True),
    "LeaseDone": protocol.LeaseDone(lease_id="r0.u1", worker="worker-1", round=0, results=[
        RolloutResult("a", 0.5, DIFF, calls=2), RolloutResult("b", None, error="boom")]),
    "Settled": protocol.Settled(lease_id="x", round=0, unit=0, scores=[("a", 1.0), ("b", None)]),
    "SettledBatch": protocol.SettledBatch(settled=[
        protocol.Settled(lease_id="x", round=0, unit=0, scores=[("a", 1.0)]),
        protocol.Settled(lease_id="y", round=0, unit=1, errors=["b: boom"], calls=2)]),
    "Barrier": protocol.Barrier(round=4),
    "EvalRequest": protocol.EvalRequest(eval_id="e1", state={"k": "v"}, task_ids=["a"]),
    "EvalDone": protocol.EvalDone(eval_id="e1", score=0.75, scores={"a": 0.75}),
    "Commit": protocol.Commit(version=2, state={"k": "v"}),
    "RoundClosed": protocol.RoundClosed(round=1, version=1, committed=True, heldout_reward=0.5,
                                        outcomes={"committed": 2}),
    "Progress": protocol.Progress(record=RECORD, rollouts=10),
    "RunDone": protocol.RunDone(stop_reason="rounds", version=1, state={}, final_reward=1.0,
                                initial_reward=0.0, history=[RECORD]),
    "Hello": protocol.Hello(worker="worker-0", slots=2, fingerprint="abc"),
    "Heartbeat": protocol.Heartbeat(worker="worker-0"),
    "Lost": protocol.Lost(worker="worker-0", reason="its process exited (code -9)"),
    "CallsAsk": protocol.CallsAsk(worker="proc-0", lease_id="r1.u0", ask=3, calls=2),
    "CallsGranted": protocol.CallsGranted(lease_id="r1.u0", ask=3, refused="max_calls"),
    "Cancel": protocol.Cancel(lease_id="x"),
    "Stop": protocol.Stop(reason="done"),
    "NeedWork": protocol.NeedWork(wave=2),
    "Merged": protocol.Merged(consumed=3, version=1),
    "WaveSettled": protocol.WaveSettled(wave=2),
    "Branched": protocol.Branched(round=3, merge=2),
    "Refresh": protocol.Refresh(reason="stall"),
    "Drain": protocol.Drain(reason="max_rollouts"),
    "Flush": protocol.Flush(cancelled=1),
    # workers in other processes
    "Join": protocol.Join(worker="w-1", slots=2, package_version="0.1.0"),
    "Spec": protocol.Spec(reward=protocol.Ref(ref="m:reward"),
                          strategy=protocol.Ref(ref="actors.artifacts:KeyedRules",
                                                    kwargs={"categories": ["a"]}),
                          inline_tasks=[protocol.Task("t1", "p", {"k": 1})], env=["API_KEY"],
                          fingerprints={"m": "ab12"}, heartbeat=0.2),
    "Refused": protocol.Refused(worker="w-1", reason="module 'x' is not allowed"),
    # parallel groups on workers in other processes
    "GroupOpen": protocol.GroupOpen(group_id="g", target=protocol.Ref(ref="m:f"),
                                    fingerprint="ab12", wants_ctx=True, returns="int"),
    "GroupOpened": protocol.GroupOpened(group_id="g", worker="w-1", error="not allowed"),
    "HostCall": protocol.HostCall(group_id="g", worker="w-1", op="store.incr",
                                  args=["k", 2], call_id="c1"),
    "HostReply": protocol.HostReply(call_id="c1", value=3, error="", error_type=""),
    # bounded parallel groups
    "GroupStart": protocol.GroupStart(
        group_id="g", items=[1, "two", {"k": [3]}, b"\x00"], workers=["w0"], max_concurrency=1,
        max_items=4, finished={0: "r0"}, pending=[protocol.PendingInteraction(
            id="g.1.0", branch=1, kind="ask", prompt="?", item="two")],
        journals={1: [protocol.JournalEntry(kind="effect", key="send", value=[1])]},
        effects=[(1, "send")], approvers=["lead"], resume=True),
    "Branch": protocol.Branch(group_id="g", lease_id="g.0", indices=[0, 2], items=[1, None]),
    "BranchDone": protocol.BranchDone(group_id="g", lease_id="g.0", indices=[0], values=[{"a": 1}],
                                      unstarted=[2], nbytes=4, elapsed=0.5),
    "BranchFailed": protocol.BranchFailed(group_id="g", lease_id="g.0", index=0, error="boom",
                                          error_type="ValueError", after_stop=True),
    "Interaction": protocol.Interaction(
        group_id="g", lease_id="g.0", index=1, journal=[protocol.JournalEntry(kind="ask", key="q",
                                                                              value="a", id="i")],
        pending=protocol.PendingInteraction(id="g.1.1", branch=1, kind="approve", prompt="ship")),
    "Hold": protocol.Hold(lease_id="g.0"),
    "Revoke": protocol.Revoke(lease_id="g.1"),
    "UserInputs": protocol.UserInputs(group_id="g", answers={"g.1.0": "x"},
                                      approvals={"g.2.0": True}, principal="lead"),
    "GroupCancel": protocol.GroupCancel(group_id="g", reason="parent cancelled"),
    "GroupResult": protocol.GroupResult(group_id="g", status="failed", error="boom",
                                        error_branch=0, finished={1: 1}, never_started=[2]),
    "GroupSuspended": protocol.GroupSuspended(
        group_id="g", status="user_input_pending",
        pending=[protocol.PendingInteraction(id="g.1.0", branch=1, kind="ask")],
        not_started=[2]),
}


def union_members() -> list[type]:
    return list(typing.get_args(Message))


def test_every_message_in_the_union_has_an_example_here():
    # Adding a message to the union without a round-trip example here fails this test.
    missing = [cls.__name__ for cls in union_members()
               if cls.__name__ not in EXAMPLES and cls.__module__ == "protocol.messages"]
    assert missing == [], f"add round-trip examples for {missing}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_message_round_trips_through_the_codec(name):
    msg = EXAMPLES[name]
    assert decode(encode(msg)) == msg
    assert type(decode(encode(msg))) is type(msg)


def test_messages_are_frozen():
    with pytest.raises(AttributeError):
        EXAMPLES["Barrier"].round = 5


def test_a_frame_that_is_not_a_message_does_not_decode():
    with pytest.raises(msgspec.DecodeError):
        decode(b"\x93\x01\x02\x03")
    with pytest.raises(msgspec.DecodeError):
        decode(msgspec.msgpack.encode({"type": "NoSuchMessage"}))


def test_an_unknown_extra_field_from_a_newer_writer_is_skipped():
    raw = msgspec.msgpack.encode({"type": "Barrier", "round": 3, "added_later": [1, 2]})
    assert decode(raw) == protocol.Barrier(round=3)


def test_tasks_hash_and_compare_by_id():
    a = protocol.Task("t1", "hello", {"x": 1})
    b = protocol.Task("t1", "other", {})
    assert a == b and len({a, b}) == 1


def test_yesterdays_recorded_logs_decode_with_todays_messages():
    """Schema evolution: every record of every log in tests/logs decodes with today's
    union, and re-encodes to a message that decodes equal (fields moved into a shared base
    Struct change the order of keys, never what they say)."""
    from pathlib import Path

    from bus.log import read_log

    logs = sorted((Path(__file__).parent / "logs").glob("*.evolog"))
    assert logs
    kinds: set[str] = set()
    for path in logs:
        contents = read_log(path)
        assert contents.records, path
        for rec in contents.records:
            msg = protocol.decode(rec.body)
            assert protocol.decode(protocol.encode(msg)) == msg, (path, rec.seq)
            kinds.add(type(msg).__name__)
    assert {"Start", "Lease", "LeaseDone", "Commit", "GroupStart", "BranchDone",
            "Interaction", "Spec"} <= kinds, sorted(kinds)
