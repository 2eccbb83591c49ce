"""Regenerate the recorded logs in tests/logs/ (replayed by tests/test_replay.py).

    python tests/logs/record.py            # every log
    python tests/logs/record.py cluster_parallel

Each log is a real run over the ZeroMQ bus: of the offline router domain
(scenarios/router.py), with the scenario text in its header so `evobus replay` rebuilds
its machines standalone, or of the tickets group (scenarios/tickets.py), whose
Collector is rebuilt from its GroupStart messages. Re-record when a control actor's decisions change on purpose (the
replay report of the old log shows what changed: keep that in the commit message), and
never to make a replay failure go away unexplained. Logs written by yesterday's code
are also yesterday's bytes: tests/test_replay.py decodes them with today's code.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

_COMMON = """
seed = 0
held_out_frac = 0.4

[domain]
tasks = "scenarios.router:tasks"
reward = "scenarios.router:reward"
agent = "scenarios.router:RouterAgent"

[strategy]
kind = "KeyedRules"
categories = ["billing", "shipping", "technical", "account"]

[workers]
local = 4
"""

SCENARIOS: dict[str, str] = {
    # Synchronous data parallel, whole-shard rounds: disjoint rotating shards, the
    # conflicts and duplicates of 43 proposals a round. (Recorded when the whole shard
    # was the default; per_worker = "shard" keeps that round.)
    "sync_data_parallel": 'name = "sync_data_parallel"\nrounds = 3\n' + _COMMON + """
[parallel]
kind = "DataParallel"
per_worker = "shard"
""",
    # The default configuration of its day, synchronous: no [parallel], which then
    # planned one task per worker, with held diffs and chained leases (its header says
    # so, and it replays as it ran); to held-out 1.0.
    "sync_default_round": 'name = "sync_default_round"\nrounds = 15\n' + _COMMON + """
[budgets]
target_reward = 1.0
""",
    # Today's default configuration, synchronous, to held-out 1.0: no [parallel], so
    # DataParallel's round of four tasks a worker, its leases unchained (each failed
    # task proposes on the head: the duplicates a chain avoided), no held diffs at four
    # workers.
    "sync_unchained_default": 'name = "sync_unchained_default"\nrounds = 15\n' + _COMMON + """
[budgets]
target_reward = 1.0
""",
    # Tensor parallel without route: tasks are sharded as in DP, so most proposals land
    # outside the proposer's section and are rejected (section-violation).
    "tensor_parallel_violations": 'name = "tensor_parallel_violations"\nrounds = 3\n'
                                  + _COMMON + """
[parallel]
kind = "TensorParallel"
n_sections = 4
""",
    # Cluster parallel: whole clusters (categories) leased by UCB, learnt via observe.
    "cluster_parallel": 'name = "cluster_parallel"\nrounds = 4\n' + _COMMON + """
[parallel]
kind = "ClusterParallel"
cluster_of = "scenarios.router:cluster_of"
""",
}

# Barrier-free: waves on NeedWork, Merged/backpressure, a lag budget of one version (so
# Refresh and re-verification of stale proposals, as work, both happen), drained by the
# rollout budget. One task per worker a wave (per_worker = 1, the default round when it
# was recorded; a wave of 4 per worker stalls less and never refreshes).
SCENARIOS["async_router"] = ('name = "async_router"\nmode = "async"\nasync_ratio = 1\n'
                             'staleness = "reflective"\n' + _COMMON + """
[parallel]
kind = "DataParallel"
per_worker = 1

[budgets]
max_rollouts = 240
""")

#: A parallel group (the tickets triage) that pauses on ctx.ask/ctx.approve and is
#: resumed from its checkpoint until it completes, on one runtime: one log, one
#: Collector name, a new Collector per GroupStart.
GROUP = "group_suspended_resumed"

#: The redispatch and the kill logs keep whole-shard rounds (per_worker = "shard"):
#: what they pin is a lease lost and re-sent, a run cut mid-round and resumed, not the
#: round size; their headers predate the default round and the recorded rule keys, so
#: they are also the older logs tests/test_replay.py replays as they ran.
#: Two process workers; the first to start a rollout is stopped (SIGSTOP) past its
#: heartbeat deadline, so the Scheduler presumes it lost and re-dispatches its lease
#: under the same id; continued (SIGCONT), it comes back and its late answer is dropped.
REDISPATCH = "redispatched_lease"
REDISPATCH_SCENARIO = """name = "redispatched_lease"
rounds = 2
seed = 0
held_out_frac = 0.4

[domain]
tasks = "tests.remote_domain:tasks"
reward = "tests.remote_domain:reward"
run = "tests.remote_domain:run"
propose = "tests.remote_domain:propose"

[strategy]
kind = "KeyedRules"
categories = ["billing", "shipping", "technical", "account"]

[parallel]
kind = "DataParallel"
per_worker = "shard"

[workers]
local = 0
processes = 2
heartbeat = 0.2
deadline = 1.0
wait_seconds = 60
"""

#: A run cut as a kill -9 with fsync="always" leaves it (a prefix of the full log), then
#: resumed: resumed_after_kill.evolog + resumed_after_kill.r1.evolog (a chain).
KILLED = "resumed_after_kill"
KILLED_SCENARIO = 'name = "resumed_after_kill"\nrounds = 2\n' + _COMMON + """
[parallel]
kind = "DataParallel"
per_worker = "shard"
"""


def record(name: str, text: str, path: Path) -> Path:
    from actors.runtime.launch import evolve_kwargs
    from actors.runtime.evolve import evolve
    from protocol.scenario import parse_scenario

    scenario = parse_scenario(text, f"tests/logs/record.py:{name}")
    kwargs = evolve_kwargs(scenario, f"tests/logs/record.py:{name}")
    kwargs["log"] = str(path)
    kwargs["log_meta"] = {**kwargs["log_meta"], "scenario_toml": text}
    result = evolve(**kwargs, log_fsync="always", log_overwrite=True)  # re-recording
    print(f"{path.name}: {result.stop_reason}, v{result.version}, held-out "
          f"{result.final_reward:.3f}, outcomes {result.outcomes()}")
    return path


def record_killed() -> None:
    """Run, keep the prefix up to the first rollout result of round 1 (leases of that
    round are still in flight there), and resume it."""
    from actors.replay.resume import resume_scenario_log
    from bus.log import LogWriter, read_log
    from protocol import LeaseDone, decode

    full = HERE / f"{KILLED}.full.tmp"
    record(KILLED, KILLED_SCENARIO, full)
    contents = read_log(full)
    cut = next(i for i, r in enumerate(contents.records)
               if r.receiver == "scheduler" and isinstance(m := decode(r.body), LeaseDone)
               and m.round == 1)
    killed = HERE / f"{KILLED}.evolog"
    with LogWriter(killed, contents.header, fsync="never", overwrite=True) as w:
        for r in contents.records[:cut + 1]:
            w.append(r.seq, r.t, r.sender, r.receiver, r.body)
    full.unlink()
    resumed = HERE / f"{KILLED}.r1.evolog"
    resumed.unlink(missing_ok=True)
    result = resume_scenario_log(killed, log=resumed, log_fsync="always")
    print(f"{resumed.name}: resumed after seq {contents.records[cut].seq}; "
          f"{result.stop_reason}, v{result.version}")


def record_group() -> None:
    """The tickets group, paused and resumed (stand-in answers) until it completes."""
    import tempfile

    from actors.groups.checkpoint import load_checkpoint
    from actors.groups.api import resume_group, run_group
    from actors.runtime.runtime import Runtime
    from scenarios.tickets import stand_in_answers, tickets

    path = HERE / f"{GROUP}.evolog"
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "group.ckpt"
        rt = Runtime(bus="zmq", log_path=str(path), fsync="always", log_overwrite=True,
                     log_meta={"scenario": "parallel-group",
                               "note": "tests/logs/record.py: tickets triage, resumed"})
        try:
            out = run_group("scenarios.tickets:triage", tickets(), max_concurrency=4,
                            max_items=32, approvers=["lead"], checkpoint=ckpt, runtime=rt)
            pauses = 0
            while out.status in ("user_input_pending", "approval_pending"):
                pauses += 1
                if pauses > 5:
                    raise SystemExit(f"{path.name}: still paused after 5 resumes")
                answers = stand_in_answers(str(ckpt))
                kinds = {p.id: p.kind for p in load_checkpoint(ckpt).pending}
                out = resume_group(
                    ckpt, principal="lead", runtime=rt,
                    user_inputs={i: a for i, a in answers.items() if kinds[i] == "ask"},
                    approvals={i: a for i, a in answers.items() if kinds[i] == "approve"})
        finally:
            rt.close()
    if out.status != "completed" or pauses == 0:
        raise SystemExit(f"{path.name}: expected a pause and a completed resume, got "
                         f"{pauses} pause(s) and {out.status}")
    print(f"{path.name}: {pauses} pause(s), then {out.status} with {len(out.results)} results")


def record_redispatch(attempts: int = 5) -> None:
    """Process workers, one stopped past its deadline mid-lease, then continued. The
    continued worker races the end of the run (the other worker finishes the round at
    once): an attempt whose run ended before the worker was back is made again."""
    for attempt in range(1, attempts + 1):
        try:
            return _record_redispatch_once()
        except SystemExit as exc:
            if attempt == attempts:
                raise
            print(f"{exc} (attempt {attempt} of {attempts}; again)")


def _record_redispatch_once() -> None:
    import logging
    import os
    import signal
    import tempfile
    import threading
    import time

    path = HERE / f"{REDISPATCH}.evolog"
    lost, back = threading.Event(), threading.Event()

    class Watch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "presumed lost" in text and "is back" not in text:
                lost.set()
            if "is back after being presumed lost" in text:
                back.set()

    watch = Watch()
    logging.getLogger("actors.machines.scheduler").addHandler(watch)
    with tempfile.TemporaryDirectory() as gate:
        os.environ["EVOBUS_TEST_GATE"] = gate  # the process workers inherit it
        result: list = []
        thread = threading.Thread(
            target=lambda: result.append(record(REDISPATCH, REDISPATCH_SCENARIO, path)),
            name="record-redispatch", daemon=True)
        thread.start()
        try:
            end = time.monotonic() + 60
            started: list[Path] = []
            while not started and time.monotonic() < end:
                started = sorted(Path(gate).glob("started-*"), key=os.path.getmtime)
                time.sleep(0.01)
            if not started:
                raise SystemExit(f"{path.name}: no process worker started a rollout in 60 s")
            victim = int(started[0].name.split("-", 1)[1])
            os.kill(victim, signal.SIGSTOP)
            (Path(gate) / "release").write_text("go")
            if not lost.wait(30):
                os.kill(victim, signal.SIGCONT)
                raise SystemExit(f"{path.name}: the stopped worker was never presumed lost")
            os.kill(victim, signal.SIGCONT)
            back.wait(30)
            thread.join(120)
        finally:
            del os.environ["EVOBUS_TEST_GATE"]
            logging.getLogger("actors.machines.scheduler").removeHandler(watch)
    if not result or not back.is_set():
        raise SystemExit(f"{path.name}: the run did not finish with the worker back "
                         f"(finished: {bool(result)}, back: {back.is_set()})")


def main(argv: list[str]) -> int:
    special = {KILLED: record_killed, GROUP: record_group, REDISPATCH: record_redispatch}
    names = argv or [*SCENARIOS, *special]
    for name in names:
        if name in special:
            special[name]()
        elif name in SCENARIOS:
            record(name, SCENARIOS[name], HERE / f"{name}.evolog")
        else:
            print(f"unknown log {name!r}; choose from {[*SCENARIOS, *special]}")
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
