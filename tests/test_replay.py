"""Replay: recorded logs as the test oracle (DESIGN sections 3 and 5).

Every ``*.evolog`` in tests/logs/ is replayed (a log added there is picked up without
touching this file); a control actor changed on purpose is caught at the right
sequence number; yesterday's bytes decode with today's code.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import msgspec
import pytest

from actors import KeyedRules, evolve
from actors.addresses import DRIVER, MERGER, PLANNER, SCHEDULER
from actors.cli.main import main as cli_main
from actors.errors import ConfigError
from actors.policies.parallelism import ClusterParallel, DataParallel, TensorParallel
from actors.replay.report import field_diff
from actors.replay.verify import replay_log
from actors.machines.scheduler import Scheduler
from actors.testing import recorded_logs, replay
from bus.log import FORMAT_VERSION, LogWriter, TornTailWarning, read_log
from protocol import (Barrier, Commit, Lease, LeaseBatch, Message, Start, Stop, decode,
                      encode)
from scenarios import router

pytestmark = pytest.mark.timeout(60)

LOGS = Path(__file__).resolve().parent / "logs"
RECORDED = recorded_logs(LOGS)


def records_of(path: Path):
    return [(r, decode(r.body)) for r in read_log(path).records]


def seq_of(path: Path, sender: str, kind: type, **fields) -> int:
    """The seq of the first record from ``sender`` holding a ``kind`` with ``fields``."""
    for rec, msg in records_of(path):
        if rec.sender == sender and isinstance(msg, kind) and all(
                getattr(msg, k) == v for k, v in fields.items()):
            return rec.seq
    raise AssertionError(f"{path.name} has no {kind.__name__} {fields} from {sender}")


def copy_log(src: Path, dst: Path, edit=lambda rec: rec) -> Path:
    """Rewrite a log record by record; ``edit`` returns a record, or None to drop it."""
    contents = read_log(src)
    with LogWriter(dst, contents.header, fsync="never") as w:
        for rec in contents.records:
            rec = edit(rec)
            if rec is not None:
                w.append(rec.seq, rec.t, rec.sender, rec.receiver, rec.body)
    return dst


# --- the recorded logs -------------------------------------------------------------------


def test_the_recorded_logs_cover_the_strategies_named_in_docs_replay_md():
    names = {p.name for p in RECORDED}
    assert {"sync_data_parallel.evolog", "tensor_parallel_violations.evolog",
            "cluster_parallel.evolog", "resumed_after_kill.evolog",
            "resumed_after_kill.r1.evolog", "async_router.evolog",
            "group_suspended_resumed.evolog", "redispatched_lease.evolog",
            "sync_default_round.evolog", "sync_unchained_default.evolog"} <= names


def test_todays_default_log_leases_unchained_and_holds_nothing_at_four_workers():
    """The default configuration as it runs today (re-record it when a default changes
    its decisions, tests/logs/record.py): DataParallel's leases unchained, no held diff;
    the log of the default of its day keeps its chained leases."""
    today = [m for _, m in records_of(LOGS / "sync_unchained_default.evolog")]
    leases = [m for m in today if isinstance(m, Lease) and m.kind == "rollout"]
    assert leases and not any(m.chain for m in leases)
    done = next(m for m in today if type(m).__name__ == "RunDone")
    assert "held" not in done.outcomes and done.final_reward == 1.0
    then = [m for _, m in records_of(LOGS / "sync_default_round.evolog")
            if isinstance(m, Lease) and m.kind == "rollout"]
    assert then and all(m.chain for m in then)


def test_a_log_from_before_the_default_round_replays_with_the_round_and_rules_it_ran():
    # Written when the default was the whole shard and no rule was recorded: its
    # scenario names DataParallel without per_worker, its header DataParallel().
    path = LOGS / "sync_data_parallel.evolog"
    meta = read_log(path).header.meta
    assert "per_worker" not in meta["scenario_toml"] and meta["parallel"] == "DataParallel()"
    merger = msgspec.json.decode(meta["machine_args"])["merger"]
    assert "screen" not in merger and "conflicts" not in merger
    assert replay_log(path).divergence is None
    # Planned with today's default round instead, it diverges at the first LeaseBatch.
    wrong = replay_log(path, parallel=DataParallel(per_worker=1)).divergence
    assert wrong is not None and wrong.actor == PLANNER


def test_a_log_written_now_records_the_round_and_every_rule_on_or_off(tmp_path):
    log = tmp_path / "run.evolog"
    evolve(tasks=router.tasks(), reward=router.reward, run=router.run,
           propose=router.propose, strategy=KeyedRules(router.CATEGORIES), rounds=2,
           seed=0, bus="memory", log=str(log), attribute=False)
    meta = read_log(log).header.meta
    assert meta["parallel"] == "DataParallel(per_worker=4)"
    merger = msgspec.json.decode(meta["machine_args"])["merger"]
    assert {k: merger[k] for k in ("screen", "attribute", "retire", "recheck", "sequential",
                                   "conflicts", "noise_z", "hold")} == {
        "screen": True, "attribute": False, "retire": True, "recheck": False,
        "sequential": True, "conflicts": "first", "noise_z": 0.0, "hold": False}
    assert replay_log(log).divergence is None


def test_hold_is_off_for_a_strategy_of_one_declared_key(tmp_path):
    """SingleSlot's diffs all write its one key: a held one would never share a gate, so
    evolve() records hold off for it (on for AppendRules and KeyedRules)."""
    from actors.artifacts import SingleSlot
    log = tmp_path / "slot.evolog"
    evolve(tasks=router.tasks(), reward=router.reward, run=router.run,
           propose=router.propose, strategy=SingleSlot(), rounds=1, seed=0, bus="memory",
           log=str(log))
    merger = msgspec.json.decode(read_log(log).header.meta["machine_args"])["merger"]
    assert merger["hold"] is False


@pytest.mark.parametrize("bus", ["zmq", "memory"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_finished_run_s_log_ends_with_every_stop_delivered(tmp_path, bus, seed):
    """The Scheduler tells each worker Stop at Shutdown; a runtime that stopped its workers
    while those were in flight left them undelivered at the log's end (seen as 4
    undelivered Stops when re-recording tests/logs)."""
    log = tmp_path / "run.evolog"
    evolve(tasks=router.tasks(), reward=router.reward, run=router.run,
           propose=router.propose, strategy=KeyedRules(router.CATEGORIES), rounds=2,
           seed=seed, bus=bus, log=str(log), n_workers=4)
    records = read_log(log).records
    stops = [r for r in records if decode(r.body).__class__ is Stop]
    assert len(stops) == 4
    assert [r for r in records if r.status != 0] == []


#: Workers' names: threads, process workers, a group's branch workers.
WORKERS = ("worker-", "proc-", "branch-worker.")


@pytest.mark.parametrize("path", RECORDED, ids=[p.name for p in RECORDED])
def test_every_recorded_log_replays_identically(path):
    report = replay(path)
    assert report.records > 0
    # Every control actor was exercised, and compared something.
    assert report.actors
    assert all(a.inputs > 0 and a.matched > 0 for a in report.actors.values()), report
    # What a replay may not find in a log is only what could not be delivered: messages
    # to workers that had left (or, for a killed run, what was in flight at the end).
    killed = "resumed_after_kill.evolog" == path.name
    for u in report.unrecorded:
        assert killed or u.receiver.startswith(WORKERS), report.format()


@pytest.mark.parametrize("path", RECORDED, ids=[p.name for p in RECORDED])
def test_yesterdays_bytes_decode_with_todays_code(path):
    """Schema evolution (STYLE): every message of a committed log decodes with today's
    typed union, every field it carries is still a field of today's message (none was
    renamed or removed: an unknown field would be skipped silently), and today's
    encoding of it decodes back to the same message."""
    contents = read_log(path)
    assert contents.header.format_version <= FORMAT_VERSION
    kinds = set()
    for rec in contents.records:
        msg = decode(rec.body)
        kind = type(msg)
        kinds.add(kind.__name__)
        raw = msgspec.msgpack.decode(rec.body)
        assert raw["type"] == kind.__name__
        dropped = set(raw) - set(kind.__struct_fields__) - {"type"}
        assert not dropped, (f"{path.name} seq {rec.seq}: {kind.__name__} fields "
                             f"{sorted(dropped)} are gone from today's code")
        assert decode(encode(msg)) == msg
    if "resumed_from" in contents.header.meta:
        return  # a resumed run's log starts mid-run
    if path.name.startswith("group_"):
        assert {"GroupStart", "Branch", "BranchDone", "Interaction", "Stop",
                "GroupSuspended", "UserInputs", "GroupResult"} <= kinds
        return
    assert {"Start", "LeaseBatch", "Lease", "LeaseDone", "EvalRequest",
            "EvalDone", "Commit", "RoundClosed", "Hello"} <= kinds
    assert kinds & {"Settled", "SettledBatch"}
    if path.name.startswith("async_"):
        assert {"NeedWork", "Merged", "Refresh", "Drain", "Flush"} <= kinds
    else:
        assert "Barrier" in kinds


def test_the_async_log_reverifies_stale_proposals_and_drains():
    closed = [m for _, m in records_of(LOGS / "async_router.evolog")
              if type(m).__name__ == "RoundClosed"]
    assert sum(m.outcomes.get("stale-rejected", 0) for m in closed) > 0
    assert closed[-1].final


def test_the_group_log_pauses_resumes_and_completes_on_one_collector_name():
    msgs = records_of(LOGS / "group_suspended_resumed.evolog")
    collectors = {r.receiver for r, m in msgs if type(m).__name__ == "GroupStart"}
    assert len(collectors) == 1
    kinds = [type(m).__name__ for r, m in msgs if r.sender in collectors
             and type(m).__name__ in ("GroupSuspended", "GroupResult")]
    assert kinds[-1] == "GroupResult" and "GroupSuspended" in kinds
    assert [m.status for _, m in msgs if type(m).__name__ == "GroupResult"] == ["completed"]


def test_a_group_resumed_on_its_collector_name_needs_a_fresh_collector():
    """Each GroupStart begins a new group at that name (a resumed group keeps its id):
    one Collector fed every life ignores the second GroupStart, and replay says so at
    the first message the resumed group's Collector sent."""
    from actors.machines.collector import Collector

    path = LOGS / "group_suspended_resumed.evolog"
    msgs = records_of(path)
    name = next(r.receiver for r, m in msgs if type(m).__name__ == "GroupStart")
    starts = [r.seq for r, m in msgs if type(m).__name__ == "GroupStart"]
    first_of_second_life = next(r.seq for r, _ in msgs if r.sender == name
                                and r.seq > starts[1])
    one = Collector(name)
    report = replay_log(path, collector=lambda _: one)
    assert report.divergence is not None and report.divergence.actor == name
    assert report.divergence.seq == first_of_second_life, report.format()


def test_a_collector_that_leases_differently_is_caught_at_that_lease():
    from actors.machines.collector import Collector

    class OneAtATime(Collector):
        """Takes one worker fewer than the group allows."""

        def handle(self, msg):
            if type(msg).__name__ == "GroupStart":
                msg = msgspec.structs.replace(msg, max_concurrency=msg.max_concurrency - 1)
            return super().handle(msg)

    path = LOGS / "group_suspended_resumed.evolog"
    report = replay_log(path, collector=OneAtATime)
    assert report.divergence is not None, report.format()
    assert report.divergence.actor.startswith("collector.")
    assert "Branch" in repr(report.divergence.expected) + repr(report.divergence.actual)


def test_the_redispatch_log_reissues_a_lost_workers_lease_under_its_id():
    msgs = records_of(LOGS / "redispatched_lease.evolog")
    leases: dict[str, list[str]] = {}
    for r, m in msgs:
        if r.sender == SCHEDULER and isinstance(m, Lease):
            leases.setdefault(m.lease_id, []).append(r.receiver)
    again = {lid: to for lid, to in leases.items() if len(to) > 1}
    assert again and all(len(set(to)) > 1 for to in again.values()), leases
    # The stopped worker came back: its answer for the re-dispatched lease is in the
    # log, and the Scheduler dropped it (one answer per lease reached the Merger).
    answers = [r.sender for r, m in msgs if r.receiver == SCHEDULER
               and type(m).__name__ == "LeaseDone" and m.lease_id in again]
    assert len(answers) >= 2
    assert all(r.receiver.startswith("proc-") for r, m in msgs if isinstance(m, Lease))


def test_the_tensor_parallel_log_holds_section_violations():
    closed = [m for _, m in records_of(LOGS / "tensor_parallel_violations.evolog")
              if type(m).__name__ == "RoundClosed"]
    assert sum(m.outcomes.get("section-violation", 0) for m in closed) > 0


def test_the_cluster_parallel_log_plans_whole_clusters():
    batches = [m for _, m in records_of(LOGS / "cluster_parallel.evolog")
               if isinstance(m, LeaseBatch)]
    for lease in batches[0].leases:
        assert len({router.cluster_of(t) for t in lease.task_ids}) == 1


# --- a decision changed on purpose is caught where it happens --------------------------


class MisroutingScheduler(Scheduler):
    """Sends lease r1.u0 to another worker than the real Scheduler did."""

    def handle(self, msg: Message):
        out = super().handle(msg)
        return [(self._elsewhere(receiver), m)
                if isinstance(m, Lease) and m.lease_id == "r1.u0" else (receiver, m)
                for receiver, m in out]

    def _elsewhere(self, receiver: str) -> str:
        others = sorted(w for w in self.workers if w != receiver)
        return others[-1]


def test_a_scheduler_that_dispatches_differently_is_caught_at_that_lease():
    path = LOGS / "sync_data_parallel.evolog"
    expected_seq = seq_of(path, SCHEDULER, Lease, lease_id="r1.u0")
    with pytest.raises(AssertionError) as info:
        replay(path, scheduler=MisroutingScheduler)
    text = str(info.value)
    assert f"first divergence at seq {expected_seq}" in text
    assert "scheduler sent a different message" in text
    report = replay_log(path, scheduler=MisroutingScheduler)
    d = report.divergence
    assert (d.seq, d.actor) == (expected_seq, SCHEDULER)
    assert d.diff[0].startswith("receiver: 'worker-") and " != 'worker-" in d.diff[0]
    assert isinstance(d.expected[1], Lease) and d.expected[1] == d.actual[1]
    # The other actors were fed the recorded inputs and still replay identically.
    assert report.other_divergences == []


class ShiftedDataParallel(DataParallel):
    """Plans round 1 (and later) with the units' shards shifted by one worker."""

    def plan(self, n_workers, round_index, keys):
        units = super().plan(n_workers, round_index, keys)
        if round_index < 1:
            return units
        shifted = units[1:] + units[:1]
        return [msgspec.structs.replace(u, keys=s.keys) for u, s in zip(units, shifted)]


def test_a_planner_whose_strategy_plans_differently_is_caught_at_that_round():
    path = LOGS / "sync_data_parallel.evolog"
    expected_seq = seq_of(path, PLANNER, LeaseBatch, round=1)
    report = replay_log(path, parallel=ShiftedDataParallel())
    d = report.divergence
    assert (d.seq, d.actor) == (expected_seq, PLANNER), report.format()
    assert d.diff[0].startswith("leases[0].task_ids[0]: '"), d.diff
    # The rounds before were planned the same way: matched outputs come first.
    assert report.actors[PLANNER].matched >= 3


def test_the_report_names_seq_actor_expected_actual_and_fields():
    path = LOGS / "sync_data_parallel.evolog"
    text = replay_log(path, scheduler=MisroutingScheduler).format()
    assert "expected: -> worker-" in text and "actual:   -> worker-" in text
    assert "Lease(lease_id='r1.u0'" in text
    assert "difference:" in text


# --- the engine on hand-made logs ----------------------------------------------------------


class Echo:
    """A toy planner: answers each Barrier(r) with Commit(version=r) to the scheduler, and
    to the driver too when r is odd."""

    def handle(self, msg):
        match msg:
            case Barrier(round=r):
                out = [(SCHEDULER, Commit(version=r, state={}))]
                if r % 2:
                    out.append((DRIVER, Commit(version=r, state={})))
                return out
            case _:
                return []


START = Start(run_id="t", seed=0, task_ids=["a", "b", "c", "d"], n_workers=1, rounds=1,
              held_out_frac=0.5, max_concurrency=1)


def hand_made(tmp_path: Path, rows: list[tuple[str, str, Message]]) -> Path:
    from bus.log import LogHeader

    path = tmp_path / "hand.evolog"
    with LogWriter(path, LogHeader(format_version=FORMAT_VERSION), fsync="never") as w:
        for seq, (sender, receiver, msg) in enumerate([(DRIVER, PLANNER, START), *rows], 1):
            w.append(seq, float(seq), sender, receiver, encode(msg))
    return path


def echo_replay(path: Path, **kw):
    return replay_log(path, machines={PLANNER: Echo()}, **kw)


def commit(r: int) -> Commit:
    return Commit(version=r, state={})


def test_outputs_recorded_after_later_inputs_still_match(tmp_path):
    # The planner's answers to seq 2 and 3 reach the log only after both inputs.
    path = hand_made(tmp_path, [(DRIVER, PLANNER, Barrier(round=0)),
                                (DRIVER, PLANNER, Barrier(round=1)),
                                (PLANNER, SCHEDULER, commit(0)),
                                (PLANNER, SCHEDULER, commit(1)),
                                (PLANNER, DRIVER, commit(1))])
    report = echo_replay(path)
    assert report.ok and report.actors[PLANNER].matched == 3 and not report.unrecorded


def test_a_recorded_message_the_machine_never_sends_is_a_divergence_at_its_seq(tmp_path):
    path = hand_made(tmp_path, [(DRIVER, PLANNER, Barrier(round=0)),
                                (PLANNER, SCHEDULER, commit(0)),
                                (PLANNER, SCHEDULER, commit(7)),  # seq 4: never produced
                                (DRIVER, PLANNER, Barrier(round=2)),
                                (PLANNER, SCHEDULER, commit(2))])
    d = echo_replay(path).divergence
    assert d.seq == 4 and d.actual is None and "did not produce" in d.reason
    assert "before its input at seq 5" in d.reason


def test_a_different_message_mid_stream_is_a_divergence_with_a_field_diff(tmp_path):
    path = hand_made(tmp_path, [(DRIVER, PLANNER, Barrier(round=0)),
                                (PLANNER, SCHEDULER, commit(5)),
                                (DRIVER, PLANNER, Barrier(round=2)),
                                (PLANNER, SCHEDULER, commit(2))])
    d = echo_replay(path).divergence
    assert d.seq == 3 and d.input_seq == 2 and d.diff == ("version: 5 != 0",)


def test_a_message_to_a_receiver_that_left_is_listed_not_failed_unless_strict(tmp_path):
    # Barrier(1) makes the planner answer the driver too; the log never got that one
    # (the driver had gone), and nothing else was sent to the driver afterwards.
    path = hand_made(tmp_path, [(DRIVER, PLANNER, Barrier(round=1)),
                                (PLANNER, SCHEDULER, commit(1)),
                                (DRIVER, PLANNER, Barrier(round=2)),
                                (PLANNER, SCHEDULER, commit(2))])
    report = echo_replay(path)
    assert report.ok
    assert [(u.actor, u.receiver, u.input_seq) for u in report.unrecorded] == \
        [(PLANNER, DRIVER, 2)]
    strict = echo_replay(path, strict=True)
    assert not strict.ok and strict.divergence.actual == (DRIVER, commit(1))


def test_a_missing_message_is_a_divergence_when_the_receiver_hears_from_it_later(tmp_path):
    path = hand_made(tmp_path, [(DRIVER, PLANNER, Barrier(round=1)),
                                (PLANNER, SCHEDULER, commit(1)),
                                (DRIVER, PLANNER, Barrier(round=3)),
                                (PLANNER, SCHEDULER, commit(3)),
                                (PLANNER, DRIVER, commit(3))])
    d = echo_replay(path).divergence
    # Commit(1) to the driver was produced but is not in the log, while the driver does
    # hear from the planner later (seq 6): not a receiver that left, a divergence, at
    # the next message the log holds from the planner.
    assert d is not None and d.actor == PLANNER and d.seq == 5
    assert d.expected == (SCHEDULER, commit(3)) and d.actual == (DRIVER, commit(1))


def test_a_log_without_start_replays_nothing_and_says_so(tmp_path):
    from bus.log import LogHeader

    path = tmp_path / "empty.evolog"
    LogWriter(path, LogHeader(format_version=FORMAT_VERSION)).close()
    report = replay_log(path)
    assert report.ok and "no Start" in report.notes[0]


def test_a_torn_tail_is_cut_with_a_warning_and_the_rest_replays(tmp_path):
    path = copy_log(LOGS / "sync_data_parallel.evolog", tmp_path / "torn.evolog")
    with open(path, "ab") as f:
        f.write(b"\x10\x00\x00\x00garbage")
    with pytest.warns(TornTailWarning):
        report = replay_log(path)
    assert report.ok and "torn tail" in report.notes[0]


# --- building machines ------------------------------------------------------------------


def router_kwargs():
    return dict(tasks=router.tasks(), reward=router.reward, run=router.run,
                propose=router.propose, strategy=KeyedRules(router.CATEGORIES))


def test_a_python_run_with_a_custom_strategy_needs_it_passed_and_then_replays(tmp_path):
    path = tmp_path / "tp.evolog"
    evolve(**router_kwargs(), parallel=TensorParallel(4, route=router.route), rounds=2,
           n_workers=4, bus="memory", log=str(path))
    with pytest.raises(ConfigError, match=r"parallel=TensorParallel\(4.*pass the same"):
        replay_log(path)
    replay(path, parallel=TensorParallel(4, route=router.route),
           strategy=KeyedRules(router.CATEGORIES))


def test_a_stateful_strategy_must_be_fresh_for_replay(tmp_path):
    path = tmp_path / "cp.evolog"
    used = ClusterParallel(router.cluster_of)
    evolve(**router_kwargs(), parallel=used, rounds=3, n_workers=4, bus="memory",
           log=str(path))
    replay(path, parallel=ClusterParallel(router.cluster_of))
    # The instance the run used has learnt from it: it plans round 0 differently.
    assert not replay_log(path, parallel=used).ok


def test_a_python_run_with_the_default_strategy_replays_without_arguments(tmp_path):
    path = tmp_path / "dp.evolog"
    evolve(**router_kwargs(), rounds=2, n_workers=3, bus="memory", log=str(path))
    replay(path)


def test_an_asynchronous_run_replays(tmp_path):
    path = tmp_path / "async.evolog"
    evolve(**router_kwargs(), asynchronous=True, max_rollouts=200, n_workers=4,
           log=str(path))
    report = replay(path)
    assert not [u for u in report.unrecorded if not u.receiver.startswith("worker-")]


# --- field diffs ---------------------------------------------------------------------------


def test_field_diff_walks_into_lists_dicts_and_nested_messages():
    a = LeaseBatch(round=1, leases=[Lease(lease_id="r1.u0", round=1, task_ids=["x"])])
    b = LeaseBatch(round=1, leases=[Lease(lease_id="r1.u1", round=1, task_ids=["x", "y"])])
    assert field_diff(a, b) == ["leases[0].lease_id: 'r1.u0' != 'r1.u1'",
                                "leases[0].task_ids: 1 items != 2 items"]
    assert field_diff(Commit(version=1, state={"k": "a"}), Commit(version=1, state={})) == \
        ["state['k']: 'a' != (missing)"]
    assert field_diff(Barrier(round=1), Commit(version=1, state={})) == \
        ["message: Barrier != Commit"]
    assert field_diff(Barrier(round=1), Barrier(round=1)) == []


# --- the CLI ---------------------------------------------------------------------------------


def test_cli_replay_batch_mode_reports_each_log_and_exits_0(capsys):
    assert cli_main(["replay", str(LOGS), "--quiet"]) == 0
    out = capsys.readouterr().out
    for p in RECORDED:
        assert f"ok       {p}" in out
    assert f"{len(RECORDED)} logs: all replay identically" in out


def test_cli_replay_exits_1_and_reports_the_divergence_of_a_tampered_log(tmp_path, capsys):
    src = LOGS / "sync_data_parallel.evolog"
    target = seq_of(src, SCHEDULER, Lease, lease_id="r1.u2")

    def retarget(rec):
        if rec.seq != target:
            return rec
        lease = decode(rec.body)
        return msgspec.structs.replace(
            rec, body=encode(msgspec.structs.replace(lease, lease_id="r1.u9")))

    tampered = copy_log(src, tmp_path / "tampered.evolog", retarget)
    assert cli_main(["replay", str(src), str(tampered)]) == 1
    out = capsys.readouterr().out
    assert f"ok       {src}" in out
    assert f"DIVERGED at seq {target} {tampered}" in out
    assert "lease_id: 'r1.u9' != 'r1.u2'" in out


def test_cli_replay_exits_2_on_an_unreadable_log(tmp_path, capsys):
    bad = tmp_path / "bad.evolog"
    bad.write_bytes(b"not a log")
    assert cli_main(["replay", str(bad)]) == 2
    assert "ERROR" in capsys.readouterr().out


def test_cli_inspect_summary_tabulates_rounds_commits_redispatches_and_discards(capsys):
    assert cli_main(["inspect", str(LOGS / "tensor_parallel_violations.evolog"),
                     "--summary"]) == 0
    out = capsys.readouterr().out
    assert "round  leases  rollouts  proposals  result" in out
    assert "section-violation" in out
    closed = [m for _, m in records_of(LOGS / "tensor_parallel_violations.evolog")
              if type(m).__name__ == "RoundClosed"]
    commits = sum(1 for r, m in records_of(LOGS / "tensor_parallel_violations.evolog")
                  if isinstance(m, Commit) and r.sender == MERGER)
    assert f"rounds {len(closed)} closed" in out and f"commits {commits}," in out
    assert "re-dispatches 0" in out


def test_cli_inspect_summary_counts_a_held_diff_once_where_it_was_decided(capsys):
    log = LOGS / "sync_default_round.evolog"
    assert cli_main(["inspect", str(log), "--summary"]) == 0
    out = capsys.readouterr().out
    done = next(m for _, m in records_of(log) if type(m).__name__ == "RunDone")
    discarded = {k: v for k, v in done.outcomes.items() if k != "committed"}
    total = ", ".join(f"{k} {v}" for k, v in sorted(discarded.items()))
    # The run's own outcomes: held is no discard, the later merge's decision is.
    assert f"discards {sum(discarded.values())} ({total})," in out, out
    assert "held 1 for the next merge" in out


def test_cli_inspect_summary_counts_a_redispatched_lease(tmp_path, capsys):
    src = LOGS / "sync_data_parallel.evolog"
    first = seq_of(src, SCHEDULER, Lease, lease_id="r0.u0")
    contents = read_log(src)
    again = next(r for r in contents.records if r.seq == first)
    with LogWriter(tmp_path / "again.evolog", contents.header, fsync="never") as w:
        for r in contents.records:
            w.append(r.seq, r.t, r.sender, r.receiver, r.body)
        w.append(contents.records[-1].seq + 1, 99.0, again.sender, "worker-3", again.body)
    assert cli_main(["inspect", str(tmp_path / "again.evolog"), "--summary"]) == 0
    assert "re-dispatches 1" in capsys.readouterr().out


def test_cli_inspect_summary_respects_the_round_filter(capsys):
    assert cli_main(["inspect", str(LOGS / "sync_data_parallel.evolog"), "--summary",
                     "--round", "1"]) == 0
    table = capsys.readouterr().out.split("round  leases")[1].split("\n\n")[0]
    rows = [line.split()[0] for line in table.strip().splitlines()[1:]]
    assert rows == ["1"]


def test_cli_inspect_summary_of_a_group_log_tabulates_its_groups(capsys):
    assert cli_main(["inspect", str(LOGS / "group_suspended_resumed.evolog"),
                     "--summary"]) == 0
    out = capsys.readouterr().out
    assert "round  leases" not in out   # no evolve run in this log: no rounds table
    header, *rows = out.split("group ")[1].split("\n\n")[0].strip().splitlines()
    assert header.split() == ["items", "bound", "leases", "finished", "failed", "waiting",
                              "status"]
    cells = [row.split() for row in rows]
    assert cells and all(len(c) == 8 for c in cells), rows
    statuses = {c[7] for c in cells}
    assert statuses <= {"user_input_pending", "approval_pending", "completed"}, statuses
    assert any(int(c[3]) > 0 for c in cells)   # leases counted


def test_replaying_ignores_warnings_of_a_whole_log():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        replay(LOGS / "cluster_parallel.evolog")
