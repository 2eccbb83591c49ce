"""Workload 8: peak memory of a 100,000-rollout run, and log bytes per rollout.

Each run happens in a fresh subprocess (``python -m bench.memory --child ...``), which
reports its peak resident set size (``VmHWM`` from /proc/self/status: the whole
process, interpreter and imports included), the resident size just before the
run, and the size of the run's message log. The same run at a tenth of the length
shows whether memory grows with run length or only with work in flight.

The workload: 400 tasks, 4 workers, leases of 10 tasks (so a run is ~10,000 leases:
per-lease bookkeeping shows), every 50th task fails and proposes a rule (so merges,
held-out evaluations and the merger's caches are exercised), the log on. agentdescent
runs the same callables (asynchronous only: its synchronous round is one rollout per
worker, 25,000 rounds here) without a log.

    python -m bench.memory [--quick] [--rollouts 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from bench.common import Row, table

N_TASKS = 400
N_WORKERS = 4
LEASE_SIZE = 10
FAIL_EVERY = 50
LIMIT_MB = 200.0


def run(rendered: str, task) -> str:
    return task.id


def reward(task, output: str) -> float:
    return 0.0 if int(task.id[1:]) % FAIL_EVERY == 0 else 1.0


def propose(rendered, task, output, score):
    return f"rule for {task.id}"


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rss_kb() -> int:
    return _status_kb("VmRSS")


def _peak_kb() -> int:
    """The process's peak resident set. VmHWM, not getrusage's ru_maxrss: on Linux
    ru_maxrss survives exec, so a child of a big parent would report the parent."""
    try:
        return _status_kb("VmHWM")
    except (OSError, RuntimeError):  # not Linux: the rusage figure (KiB there too)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(lib: str, mode: str, rollouts: int, log_path: str | None) -> dict:
    """Run one workload in this process; what it cost."""
    asynchronous = mode == "async"
    if lib == "evobus":
        from actors import AppendRules, DataParallel, Task, evolve
        from actors.machines.planner import split_tasks

        tasks = [Task(f"t{i}", f"task {i}") for i in range(N_TASKS)]
        train = len(split_tasks([t.id for t in tasks], 0.4, 0)[0])
        kw = (dict(max_rollouts=rollouts) if asynchronous
              else dict(rounds=max(1, round(rollouts / train))))
        before = _rss_kb()
        t = time.perf_counter()
        result = evolve(tasks, reward, run=run, propose=propose, strategy=AppendRules(),
                        parallel=DataParallel(),  # whole-shard leases: the workload measured
                        n_workers=N_WORKERS, seed=0, asynchronous=asynchronous,
                        lease_size=LEASE_SIZE, log=log_path, **kw)
        seconds = time.perf_counter() - t
        done = result.rollouts
    else:
        from bench import agentdescent_side as ad
        from actors import Task

        tasks = ad.tasks_for([Task(f"t{i}", f"task {i}") for i in range(N_TASKS)], 0.4)
        before = _rss_kb()
        t = time.perf_counter()
        result, _ = ad._evolve(tasks, reward, run, propose, asynchronous=asynchronous,
                               n_workers=N_WORKERS, rollouts=rollouts)
        seconds = time.perf_counter() - t
        done = result.rollouts
    peak = _peak_kb()
    log_bytes = os.path.getsize(log_path) if log_path and os.path.exists(log_path) else 0
    return {"before_kb": before, "peak_kb": peak, "rollouts": done, "seconds": seconds,
            "log_bytes": log_bytes}


def measure(lib: str, mode: str, rollouts: int, *, log: bool = True,
            timeout: float = 600.0) -> dict:
    """Run ``child`` in a fresh interpreter; its report."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "bench.memory", "--child", lib, "--mode", mode,
                "--rollouts", str(rollouts)]
        if log:
            args += ["--log", os.path.join(tmp, "mem.evolog")]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=root)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"memory child ({lib} {mode}) failed: {' | '.join(tail)}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def rows(rollouts: int, *, with_agentdescent: bool = True) -> list[Row]:
    from bench import agentdescent_side as ad

    out: list[Row] = []
    short = max(1000, rollouts // 10)
    for mode in ("sync", "async"):
        big = measure("evobus", mode, rollouts)
        small = measure("evobus", mode, short)
        theirs = None
        note = [f"{big['rollouts']:,} rollouts in {big['seconds']:.1f} s; "
                f"{short:,}-rollout run peaks at {small['peak_kb'] / 1024:.0f} MB; "
                f"before the run {big['before_kb'] / 1024:.0f} MB"]
        if mode == "async" and with_agentdescent:
            if ad.available():
                theirs = measure("agentdescent", mode, rollouts, log=False)
                note.append(f"agentdescent: {theirs['rollouts']:,} rollouts, no log")
            else:
                note.append(ad.NOT_INSTALLED)
        peak = big["peak_kb"] / 1024
        out.append(Row(f"(8) peak RSS, {rollouts:,}-rollout run, {mode} (whole process)",
                       "MB", [peak], "", None, [theirs["peak_kb"] / 1024] if theirs else None,
                       higher_is_better=False, target=f"< {LIMIT_MB:.0f} MB",
                       met=peak < LIMIT_MB, note="; ".join(note)))
        per = big["log_bytes"] / max(1, big["rollouts"])
        out.append(Row(f"(8) log bytes per rollout, {mode}", "bytes", [per],
                       note=f"{big['log_bytes'] / 1e6:.1f} MB log for {big['rollouts']:,} "
                            f"rollouts (leases of {LEASE_SIZE}, a proposal every "
                            f"{FAIL_EVERY}th task)"))
    return out


def suite(quick: bool = False) -> list[Row]:
    return rows(10_000 if quick else 100_000, with_agentdescent=not quick)


def main(argv=None) -> list[Row] | None:
    p = argparse.ArgumentParser(description="peak memory and log bytes per rollout")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rollouts", type=int, default=100_000)
    p.add_argument("--child", choices=["evobus", "agentdescent"])
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument("--log")
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.mode, args.rollouts, args.log)))
        return None
    result = suite(True) if args.quick else rows(args.rollouts)
    print(table([(r.workload, r.evobus, r.agentdescent, r.note) for r in result],
                ("workload", "evobus", "agentdescent", "note")))
    return result


if __name__ == "__main__":
    main()
