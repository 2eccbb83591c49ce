"""Replay speed: messages per second replayed through the Planner, Scheduler and Merger
for a ~100,000-message log, beside the raw msgspec decode rate of the same log's
messages (the ratio is what to read: the machine is shared and noisy; target >= 0.3).

    python -m bench.replay [--messages 100000] [--repeats 5] [--log PATH]

The log is a real run (in-memory bus, 8 workers, 120 tasks, KeyedRules over six
categories) of a domain that never converges: every rollout proposes one of three
texts for its category, so every round has duplicates, conflicts scored on held-out
tasks, fused candidates and rejections; the merger does real work. It is generated
once (about 10-20 s) into PATH, or reused when PATH exists.

Per repeat, on the same records, timed on the process's CPU clock
(``time.process_time``: other jobs on a shared machine stretch wall time, much less
CPU time):

- raw decode: ``protocol.decode`` of every message body, records already in memory;
- read + decode (from file): ``bus.log.read_log`` (read, checksum, decode the records)
  then ``protocol.decode`` of every body: the baseline for replay from the file;
- replay (in memory): :func:`actors.replay.replay_contents` on the same records: build
  the machines, decode the inputs, run ``handle``, encode and compare every output;
- replay (from file): :func:`actors.replay.replay_log`: also reads and checksums the
  file, which the in-memory figure leaves out;
- engine only: the same replay with oracle machines whose ``handle`` returns the
  outputs the real machines produced (precomputed): what replay itself costs (decode
  the inputs, encode and compare the outputs, bookkeeping) without the control
  actors' own work.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
import zlib
from pathlib import Path

from actors import DataParallel, KeyedRules, Task, evolve
from actors.replay.verify import replay_contents, replay_log
from bench.common import fmt, stats
from bus.log import read_log
from protocol import decode

CATEGORIES = [f"c{i}" for i in range(6)]


def make_tasks() -> list[Task]:
    return [Task(f"{c}-{j}", f"task {c} {j}", meta={"category": c})
            for c in CATEGORIES for j in range(20)]


def run(rendered: str, task: Task) -> str:
    return rendered


def reward(task: Task, output: str) -> float:
    return (zlib.crc32((output + task.id).encode()) % 10) / 10


def propose(rendered: str, task: Task, output: str, score: float) -> str:
    category = task.meta["category"]
    return f"{category}: v{zlib.crc32((task.id + rendered).encode()) % 3}"


def generate(path: Path, messages: int) -> None:
    def one(rounds: int) -> int:
        evolve(make_tasks(), reward, run=run, propose=propose,
               strategy=KeyedRules(CATEGORIES), parallel=DataParallel(), rounds=rounds,
               n_workers=8, seed=1,
               bus="memory", log=str(path))
        return len(read_log(path).records)

    calibration = 40
    per_round = one(calibration) / calibration
    rounds = math.ceil(messages / per_round * 1.01)
    n = one(rounds)
    while n < messages:  # the estimate fell short: a few more rounds
        rounds = math.ceil(rounds * messages / n) + 1
        n = one(rounds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--log", type=Path,
                   default=Path(tempfile.gettempdir()) / "evobus-bench-replay.evolog")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)

    # The log is kept between runs; one written by other code (control actors that
    # decide differently now) no longer replays identically and is written anew.
    if (not args.log.exists() or len(read_log(args.log).records) < args.messages
            or not replay_contents([read_log(args.log)]).ok):
        t = time.perf_counter()
        generate(args.log, args.messages)
        print(f"generated {args.log} in {time.perf_counter() - t:.1f} s")
    contents = read_log(args.log)
    records = contents.records
    n = len(records)
    size = args.log.stat().st_size
    print(f"log: {n:,} messages, {size / 1e6:.1f} MB ({args.log})")

    oracle = _oracle_machines(contents)
    clock = time.process_time
    raw, full, mem, disk, engine = [], [], [], [], []
    for _ in range(args.repeats):  # interleaved, so drifts in machine load hit all four
        t = clock()
        for rec in records:
            decode(rec.body)
        raw.append(n / (clock() - t))
        t = clock()
        for rec in read_log(args.log).records:
            decode(rec.body)
        full.append(n / (clock() - t))
        t = clock()
        report = replay_contents([contents])
        mem.append(n / (clock() - t))
        assert report.ok, report.format()
        t = clock()
        report = replay_log(args.log)
        disk.append(n / (clock() - t))
        assert report.ok, report.format()
        machines = oracle()
        t = clock()
        assert replay_contents([contents], machines=machines).ok
        engine.append(n / (clock() - t))

    inputs = sum(a.inputs for a in report.actors.values())
    outputs = sum(a.matched for a in report.actors.values())
    print(f"replayed {inputs:,} inputs, compared {outputs:,} outputs; median (min, max) "
          f"of {args.repeats} repeats, CPU time:")
    rows = [("raw decode", raw, raw), ("replay (in memory)", mem, raw),
            ("engine only (oracle)", engine, raw), ("read + decode (file)", full, full),
            ("replay (from file)", disk, full)]
    for name, values, base in rows:
        ratio = [v / r for v, r in zip(values, base)]
        lo, med, hi = stats(ratio)
        against = "raw decode" if base is raw else "read + decode"
        print(f"  {name:<22} {fmt(values, ' msg/s'):<44} {med:.2f} ({lo:.2f}-{hi:.2f}) "
              f"of {against}")
    handle = 1 - stats(mem)[1] / stats(engine)[1]
    print(f"  the control actors' own handle() is ~{handle:.0%} of the in-memory replay")
    return 0


FORWARD = object()


def _oracle_machines(contents):
    """Factory of machines that answer each input with what the real machine answered
    (recorded once, here): replaying with them times the engine alone."""
    from actors.replay.engine import build_machines, _find_start

    _, start = _find_start([contents])
    real = build_machines(dict(contents.header.meta), start)
    answers: dict[str, list] = {name: [] for name in real}

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def handle(self, msg):
            out = real[self.name].handle(msg)
            # A message forwarded as received is marked, so the oracle forwards the
            # message it is handed too (replay treats a forward apart: no re-decode).
            answers[self.name].append([(to, FORWARD if m is msg else m) for to, m in out])
            return out

    assert replay_contents([contents], machines={k: Recorder(k) for k in real}).ok

    class Oracle:
        def __init__(self, name: str) -> None:
            self.next = iter(answers[name]).__next__

        def handle(self, msg):
            return [(to, msg if m is FORWARD else m) for to, m in self.next()]

    return lambda: {name: Oracle(name) for name in real}


if __name__ == "__main__":
    raise SystemExit(main())
