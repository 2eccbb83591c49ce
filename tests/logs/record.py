"""Regenerate the recorded logs in tests/logs/ (replayed by tests/test_replay.py).

    python tests/logs/record.py            # every log
    python tests/logs/record.py cluster_parallel

Each log is a real run of the offline router domain (scenarios/router.py) over the
ZeroMQ bus, with the scenario text in its header so `evobus replay` rebuilds its
machines standalone. Re-record when a control actor's decisions change on purpose (the
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
    # Synchronous data parallel: disjoint rotating shards, conflicts and duplicates.
    "sync_data_parallel": 'name = "sync_data_parallel"\nrounds = 3\n' + _COMMON + """
[parallel]
kind = "DataParallel"
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

#: A run cut as a kill -9 with fsync="always" leaves it (a prefix of the full log), then
#: resumed: resumed_after_kill.evolog + resumed_after_kill.r1.evolog (a chain).
KILLED = "resumed_after_kill"
KILLED_SCENARIO = 'name = "resumed_after_kill"\nrounds = 2\n' + _COMMON + """
[parallel]
kind = "DataParallel"
"""


def record(name: str, text: str, path: Path) -> Path:
    from actors.launch import evolve_kwargs
    from actors.runtime import evolve
    from protocol.scenario import parse_scenario

    scenario = parse_scenario(text, f"tests/logs/record.py:{name}")
    kwargs = evolve_kwargs(scenario, f"tests/logs/record.py:{name}")
    kwargs["log"] = str(path)
    kwargs["log_meta"] = {**kwargs["log_meta"], "scenario_toml": text}
    result = evolve(**kwargs, log_fsync="always")
    print(f"{path.name}: {result.stop_reason}, v{result.version}, held-out "
          f"{result.final_reward:.3f}, outcomes {result.outcomes()}")
    return path


def record_killed() -> None:
    """Run, keep the prefix up to the first rollout result of round 1 (leases of that
    round are still in flight there), and resume it."""
    from actors.resume import resume_scenario_log
    from bus.log import LogWriter, read_log
    from protocol import LeaseDone, decode

    full = HERE / f"{KILLED}.full.tmp"
    record(KILLED, KILLED_SCENARIO, full)
    contents = read_log(full)
    cut = next(i for i, r in enumerate(contents.records)
               if r.receiver == "scheduler" and isinstance(m := decode(r.body), LeaseDone)
               and m.round == 1)
    killed = HERE / f"{KILLED}.evolog"
    with LogWriter(killed, contents.header, fsync="never") as w:
        for r in contents.records[:cut + 1]:
            w.append(r.seq, r.t, r.sender, r.receiver, r.body)
    full.unlink()
    resumed = HERE / f"{KILLED}.r1.evolog"
    resumed.unlink(missing_ok=True)
    result = resume_scenario_log(killed, log=resumed, log_fsync="always")
    print(f"{resumed.name}: resumed after seq {contents.records[cut].seq}; "
          f"{result.stop_reason}, v{result.version}")


def main(argv: list[str]) -> int:
    names = argv or [*SCENARIOS, KILLED]
    for name in names:
        if name == KILLED:
            record_killed()
        elif name in SCENARIOS:
            record(name, SCENARIOS[name], HERE / f"{name}.evolog")
        else:
            print(f"unknown log {name!r}; choose from {[*SCENARIOS, KILLED]}")
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
