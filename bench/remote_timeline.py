"""Where the time of ``bench.remote --group`` goes: one group's timeline per connection.

    python -m bench.remote_timeline [--connections 256] [--items 10000] [--procs 4]

Runs the group row once (the same workers, the same ``run_group`` call) with the broker
writing its log, and with workers that note, on their own clock, when each lease
arrived (the I/O thread), started and ended (the slot). It prints:

- the group's phases (``outcome.stats["phases"]``: start, run, stop);
- from the log (seconds after ``GroupStart``): when each connection's first lease left
  the broker, when its last answer came back, and the answer path (worker -> relay ->
  Collector);
- from the workers: when each connection's first lease started, the gap between the end
  of one of its leases and the start of the next, the latency from a lease's answer
  leaving the slot to the broker, and the wall time per branch by lease size (a branch
  sleeps 50 ms: what is above is oversleep);
- messages by kind in the group's window and per 100 ms;
- the CPU of every process of the bench (the coordinator and each worker process)
  and of the whole machine, in the windows start / middle / tail, from /proc.

The workers' clock is the same CLOCK_MONOTONIC as the coordinator's; the log's ``t`` is
mapped onto it by the smallest (answer received - answer sent) over the leases, so
worker-side times are late by at most that latency (printed).
"""

from __future__ import annotations

import argparse
import collections
import logging
import multiprocessing
import os
import sys
import tempfile
import threading
import time

from actors.groups.served import BranchService

_TCK = os.sysconf("SC_CLK_TCK")


class TracedService(BranchService):
    """The worker's group service, noting when each lease arrived, started and ended."""

    trace: list = []

    def queued(self, lease) -> bool:
        self.trace.append(("arrive", self.worker, lease.lease_id, time.monotonic()))
        return super().queued(lease)

    def run(self, lease, settle) -> None:
        self.trace.append(("start", self.worker, lease.lease_id, time.monotonic()))
        try:
            super().run(lease, settle)
        finally:
            self.trace.append(("end", self.worker, lease.lease_id, time.monotonic()))


def _traced_worker():
    """RemoteWorker noting when it sends its Join (the registration's first message)."""
    from actors.workers.remote import RemoteWorker

    class TracedWorker(RemoteWorker):
        def _join(self) -> None:
            TracedService.trace.append(("join", self.name, "", time.monotonic()))
            super()._join()

    return TracedWorker


def _worker_process(address: str, first: int, count: int, rollout: float, ready, done,
                    out) -> None:
    os.environ["EVOBUS_BENCH_ROLLOUT"] = str(rollout)
    logging.basicConfig(level=logging.WARNING)
    import zmq

    RemoteWorker = _traced_worker()
    ctx = zmq.Context(io_threads=2)
    workers = [RemoteWorker(address, worker_id=f"bench-{i}", allow=["bench"],
                            broker_timeout=10.0, give_up=15.0, ctx=ctx,
                            branches=TracedService)
               for i in range(first, first + count)]
    for w in workers:
        threading.Thread(target=w.run, name=w.name, daemon=True).start()
    end = time.monotonic() + 60   # every endpoint made and connecting, as bench.remote
    while any(w.ep is None for w in workers) and time.monotonic() < end:
        time.sleep(0.01)
    ready.release()
    done.wait(600)
    out.put(list(TracedService.trace))


def _cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TCK


def _machine() -> tuple[float, float]:
    """(all CPU seconds, idle CPU seconds) of the machine so far."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) / _TCK, (v[3] + v[4]) / _TCK


class _Sampler:
    """CPU seconds of each process and of the machine, every 50 ms."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.samples = pids, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            self.samples.append((time.monotonic(), [_cpu(p) for p in self.pids],
                                 *_machine()))

    def window(self, t0: float, t1: float) -> tuple[float, list[float], float]:
        """(seconds, cores used by each process, cores the machine used) over [t0, t1]."""
        a = min(self.samples, key=lambda s: abs(s[0] - t0))
        b = min(self.samples, key=lambda s: abs(s[0] - t1))
        dt = max(1e-9, b[0] - a[0])
        return dt, [(y - x) / dt for x, y in zip(a[1], b[1])], \
            ((b[2] - a[2]) - (b[3] - a[3])) / dt


def q(xs: list[float]) -> str:
    """min / median / p90 / max of ``xs``."""
    if not xs:
        return "-"
    xs = sorted(xs)
    n = len(xs)
    return f"min {xs[0]:.3f} med {xs[n // 2]:.3f} p90 {xs[9 * n // 10]:.3f} max {xs[-1]:.3f}"


def run(connections: int, items: int, procs: int, rollout: float, log_path: str):
    """One group as bench.remote.measure_group runs it, logged and traced."""
    from actors import run_group
    from bench.remote import free_port
    from protocol.scenario import Workers

    address = f"tcp://127.0.0.1:{free_port()}"
    ctx = multiprocessing.get_context("spawn")
    ready, done, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    per = [connections // procs + (1 if i < connections % procs else 0) for i in range(procs)]
    children, first = [], 0
    for count in per:
        p = ctx.Process(target=_worker_process, daemon=True,
                        args=(address, first, count, rollout, ready, done, out))
        p.start()
        children.append(p)
        first += count
    for _ in children:
        if not ready.acquire(timeout=120):
            raise RuntimeError("the worker processes did not start within 120 s")
    sampler = _Sampler([os.getpid()] + [p.pid for p in children])
    t_call = time.monotonic()
    try:
        outcome = run_group("bench.remote:branch", list(range(items)),
                            max_concurrency=connections, max_items=items, log=log_path,
                            log_overwrite=True,
                            workers=Workers(local=0, remote=connections, bind=address,
                                            wait_seconds=120, heartbeat=1.0, deadline=10.0))
        call_s = time.monotonic() - t_call
    finally:
        sampler.stop.set()
        sampler.thread.join(2)
        done.set()
        traces = []
        for _ in children:
            try:
                traces += out.get(timeout=30)
            except Exception:  # a worker process that died: its trace is missing
                break
        for p in children:
            p.join(10)
            if p.is_alive():
                p.terminate()
    if outcome.status != "completed" or outcome.results != list(range(items)):
        raise RuntimeError(f"the group ended {outcome.status}: {outcome.error}")
    return outcome, call_s, traces, sampler


def report(outcome, call_s: float, traces: list, sampler: _Sampler, log_path: str,
           rollout: float, connections: int, items: int, procs: int = 4) -> None:
    from bus.log import read_log
    from protocol import Codec

    codec = Codec()
    records = [(r, codec.decode(r.body)) for r in read_log(log_path).records]
    t_start = next(r.t for r, m in records if type(m).__name__ == "GroupStart")
    t_result = next(r.t for r, m in records if type(m).__name__ == "GroupResult")
    ideal = items * rollout / connections
    print(f"{connections} connections, {items} branches of {rollout * 1000:g} ms: ideal "
          f"{ideal:.3f} s; elapsed {outcome.stats['elapsed']:.3f} s (efficiency "
          f"{ideal / outcome.stats['elapsed']:.3f}), phases {outcome.stats['phases']}; "
          f"call to return {call_s:.3f} s; GroupStart -> GroupResult "
          f"{t_result - t_start:.3f} s (load {os.getloadavg()[0]:.1f})")
    t0 = records[0][0].t
    phases = collections.defaultdict(list)
    for r, m in records:
        if r.t < t_start:
            phases[type(m).__name__].append(r.t - t0)
    print(f"before GroupStart (s after the log's first record; GroupStart at "
          f"{t_start - t0:.3f}, the call started {call_s - (t_result - t0):.3f} s before "
          "that record): " + "; ".join(f"{k} x{len(v)} {v[0]:.3f}-{v[-1]:.3f}"
                                       for k, v in phases.items()))
    per = -(-connections // procs)   # connections a worker process hosts (bench-<i>)
    joins = collections.defaultdict(list)
    for r, m in records:
        if type(m).__name__ == "Join" and r.sender.startswith("bench-"):
            joins[int(r.sender[6:]) // per].append(r.t - t0)
    for proc, ts in sorted(joins.items()):
        print(f"worker process {proc}: its connections' Joins, s after the log's first "
              f"record: {q(ts)}")
    first_out: dict[str, float] = {}
    to_worker, answers, sent, relayed = {}, {}, {}, {}
    kinds = collections.Counter()
    buckets = collections.Counter()
    for r, m in records:
        name = type(m).__name__
        if t_start <= r.t <= t_result:
            kinds[name + (" (peer)" if r.peer else "")] += 1
            buckets[int((r.t - t_start) * 10)] += 1
        if name == "Branch" and r.sender == "groups":
            first_out.setdefault(r.receiver, r.t - t_start)
            to_worker[(r.receiver, m.lease_id)] = r.t
        elif name == "Branch":
            sent[m.lease_id] = r.t
        elif name in ("BranchDone", "BranchFailed") and r.receiver == "groups":
            answers[(r.sender, m.lease_id)] = (r.t, m.elapsed, len(m.indices))
        elif name in ("BranchDone", "BranchFailed"):
            relayed[m.lease_id] = r.t
    print("first lease leaves the broker for its worker, s after GroupStart:",
          q(list(first_out.values())))
    print("a lease, Collector -> relay -> worker at the broker, s:",
          q([t - sent[lid] for (w, lid), t in to_worker.items() if lid in sent]))
    print("an answer, worker -> relay -> Collector at the broker, s:",
          q([relayed[lid] - t for (w, lid), (t, _, _) in answers.items() if lid in relayed]))
    last = collections.defaultdict(float)
    for (w, _), (t, _, _) in answers.items():
        last[w] = max(last[w], t - t_start)
    print("last answer of each connection, s after GroupStart:", q(list(last.values())))
    _worker_side(traces, answers, t_start, rollout)
    print("messages in the group's window by kind:", dict(kinds.most_common()))
    print("messages per 100 ms:", [buckets[i] for i in range(max(buckets) + 1)])
    _cpu_report(sampler, outcome, t_start, records[0][0].t, answers, traces)


def _offset(traces: list, answers: dict) -> float:
    """log t = worker clock + offset (within the smallest answer latency)."""
    start = {(w, lid): t for kind, w, lid, t in traces if kind == "start"}
    return min((t - (start[key] + elapsed) for key, (t, elapsed, k) in answers.items()
                if key in start and k), default=0.0)


def _worker_side(traces: list, answers: dict, t_start: float, rollout: float) -> None:
    if not traces:
        print("no worker traces")
        return
    off = _offset(traces, answers)
    leases: dict[str, dict[str, dict[str, float]]] = collections.defaultdict(dict)
    for kind, w, lid, t in traces:
        leases[w].setdefault(lid, {})[kind] = t + off - t_start
    firsts, gaps, latency = [], [], []
    for w, by_lease in leases.items():
        runs = sorted((e for e in by_lease.values() if "start" in e and "end" in e),
                      key=lambda e: e["start"])
        if runs:
            firsts.append(runs[0]["start"])
        gaps += [b["start"] - a["end"] for a, b in zip(runs, runs[1:])]
    for (w, lid), (t, elapsed, k) in answers.items():
        e = leases.get(w, {}).get(lid)
        if e and "start" in e and k:
            latency.append(t - t_start - (e["start"] + elapsed))
    joins = [t + off - t_start for kind, w, lid, t in traces if kind == "join"]
    print("a worker sends its Join, s after GroupStart (negative: before):", q(joins))
    print("first lease starts on its worker, s after GroupStart:", q(firsts))
    print("a worker's gap between the end of a lease and the start of its next, s:", q(gaps))
    print("an answer from the slot to the broker, s:", q(latency))
    by_size = collections.defaultdict(list)
    for t, elapsed, k in answers.values():
        if k:
            by_size[k].append(elapsed / k)
    for k in sorted(by_size):
        xs = sorted(by_size[k])
        print(f"leases of {k} ({len(xs)}): wall per {rollout * 1000:g} ms branch: {q(xs)} "
              f"(median oversleep {xs[len(xs) // 2] / rollout - 1:.1%})")


def _cpu_report(sampler: _Sampler, outcome, t_start: float, t_first: float,
                answers: dict, traces: list) -> None:
    # The log's clock started before its first record; a worker trace gives the offset.
    off = _offset(traces, answers) if traces else None
    if off is None or not sampler.samples:
        return
    start = t_start - off   # GroupStart on the monotonic clock
    end = start + outcome.stats["elapsed"]
    for a, b, what in ((start, start + 0.3, "start (0.3 s)"),
                       (start + 0.3, end - 0.6, "middle"), (end - 0.6, end, "tail (0.6 s)"),
                       (start, end, "whole group")):
        if b <= a:
            continue
        dt, per, machine = sampler.window(a, b)
        print(f"CPU, {what}, {dt:.2f} s: coordinator {per[0]:.2f} cores, worker processes "
              f"{', '.join(f'{x:.2f}' for x in per[1:])} (sum {sum(per):.2f}); the machine "
              f"{machine:.2f} of {os.cpu_count()} cores")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=256)
    ap.add_argument("--items", type=int, default=10_000)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--rollout", type=float, default=0.05)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="evobus-timeline-") as tmp:
        path = os.path.join(tmp, "group.evolog")
        outcome, call_s, traces, sampler = run(args.connections, args.items, args.procs,
                                               args.rollout, path)
        report(outcome, call_s, traces, sampler, path, args.rollout, args.connections,
               args.items, args.procs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
