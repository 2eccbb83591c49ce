"""What ``evobus run`` shows while a run goes on and when it ends.

On a terminal: a live panel (rich) under one line per round (or merge, in async mode)
with the held-out reward, commits, rollouts per second, workers and the budget left;
the clock ticks between rounds. Anywhere else (a pipe, a file, CI): one plain line per
round, flushed at once, so ``evobus run ... | tee`` and log collectors read it as it
comes. ``--quiet`` shows nothing but errors; ``--json`` keeps stdout for the JSON
summary and shows progress on stderr.

The display only reads what the runtime reports through ``on_progress`` (one
``RoundRecord`` per round) plus the scenario; fields a newer runtime adds to the
record (``workers_alive``, ``calls``) are shown when present.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Any, Iterator, TextIO

from rich.console import Console
from rich.live import Live
from rich.panel import Panel
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from actors.cli.figures import baseline_lines
from actors.cli.live import InRound, RoundSnapshot
from bus.log import LogCorrupt, read_log

__all__ = ["GroupProgressView", "Interrupted", "RunProgress", "StepsView", "exit_code",
           "interrupt_guard", "outcome_text", "stopped"]


def outcome_text(outcomes: dict[str, int], sep: str = ", ") -> str:
    """``{"committed": 4, "duplicate": 35}`` -> ``"committed 4, duplicate 35"``."""
    order = ["committed", "conflict", "below-threshold", "duplicate", "unchanged",
             "section-violation", "rollout-error"]
    keys = sorted(outcomes, key=lambda k: (order.index(k) if k in order else len(order), k))
    return sep.join(f"{k} {outcomes[k]}" for k in keys if outcomes[k]) or "none"


def _rate(n: float, seconds: float) -> str:
    if seconds <= 0:
        return "-"
    r = n / seconds
    return f"{r:,.0f}/s" if r >= 100 else f"{r:.1f}/s"


def _clock(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class _Lines:
    """Plain lines to a stream that may be a terminal, a file or a pipe that closes."""

    stream: TextIO
    _closed_pipe = False

    def _print(self, text: str) -> None:
        if self._closed_pipe:
            return
        try:
            print(text, file=self.stream, flush=True)
        except BrokenPipeError:
            # The reader went away (`evobus run ... | head`): the run goes on, silently;
            # later writes (and the one at exit) go to /dev/null instead of failing.
            self._closed_pipe = True
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.stream.fileno())
            except (OSError, ValueError, AttributeError):  # not a real file: nothing to do
                pass

    def _isatty(self) -> bool:
        try:
            return self.stream.isatty() and os.environ.get("TERM") != "dumb"
        except (AttributeError, ValueError):  # a closed or odd stream: not a terminal
            return False

    def _want_live(self, live: bool | None, quiet: bool) -> bool:
        """A live display: asked for, or (None) on a terminal; never with ``quiet``, and
        never without rich installed (plain lines are the fallback)."""
        if quiet:
            return False
        if live is None:
            live = self._isatty()
        return bool(live) and importlib.util.find_spec("rich") is not None


class RunProgress(_Lines):
    """Progress of one scenario run. Use as a context manager and pass it as
    ``on_progress``; then call :meth:`summary` with the result (or :meth:`interrupted`).

    ``live``: None picks the live panel when ``stream`` is a terminal (and rich is
    installed), plain lines otherwise; True/False force one or the other.
    """

    def __init__(self, scenario: Any, *, source: str = "", quiet: bool = False,
                 stream: TextIO | None = None, live: bool | None = None,
                 log_path: str | None = None, doing: str = "running") -> None:
        self.scenario = scenario
        self.doing = doing   # the opening line's verb: "running", "resuming"
        self._before = 0.0   # seconds the earlier logs of a resumed run cover
        self.source = source or getattr(scenario, "name", "scenario")
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stdout
        self.log_path = log_path
        self.word = "merge" if getattr(scenario, "mode", "sync") == "async" else "round"
        self.t0 = time.monotonic()
        self.records: list[Any] = []
        self.rollouts = 0
        self.commits = 0
        self.best = None
        self.since_commit = 0
        self._lock = threading.Lock()
        self._console = None
        self._live = None
        self.live = self._want_live(live, quiet)
        self.in_round = InRound()
        if not quiet:
            # evolve() hands the runtime this, which tells it of every message: the
            # panel moves inside a round, and rates are over working time (the figures
            # `inspect --summary` folds from the log, folded live).
            self.watch = self.in_round.push
        if self.live:
            self._console = Console(file=self.stream, highlight=False)

    # -- the run ------------------------------------------------------------------------

    def carry_on(self, contents) -> None:
        """A resumed run (``contents``: its earlier logs, oldest first): its rounds,
        rollouts, rates and clock go on from theirs."""
        self._before, closed = self.in_round.carry_on(contents)
        self.records = list(closed)
        self.rollouts = sum(c.rollouts for c in self.in_round.figures.closed)
        self.commits = sum(bool(c.committed) for c in closed)
        self.best = max((c.heldout_reward for c in closed), default=None)

    def __enter__(self) -> "RunProgress":
        self.t0 = time.monotonic() - self._before
        if self.live:

            self._live = Live(console=self._console, get_renderable=self._panel,
                              refresh_per_second=4, transient=True,
                              redirect_stdout=False, redirect_stderr=True)
            self._live.start()
        elif not self.quiet:
            limit = f", up to {self.scenario.rounds} rounds" if self.word == "round" else ""
            self._print(f"{self.scenario.name}: {self.doing} {self.source} with "
                        f"{self._workers_text()}{limit}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __call__(self, record: Any) -> None:
        """``on_progress``: one round (or merge) has closed."""
        with self._lock:
            prev = self.records[-1].heldout_reward if self.records else None
            self.records.append(record)
            self.rollouts += record.rollouts
            self.commits += bool(record.committed)
            self.since_commit = 0 if record.committed else self.since_commit + 1
            self.best = record.heldout_reward if self.best is None \
                else max(self.best, record.heldout_reward)
        if self.quiet:
            return
        if self.live:
            # A narrow terminal wraps the line: nothing of it is cut.
            self._console.print(self._round_line_rich(record, prev), overflow="fold")
            if self._live is not None:
                self._live.refresh()  # the panel shows this round now, not at the next tick
        else:
            self._print(self._round_line(record))

    # -- lines ----------------------------------------------------------------------------

    def _workers_text(self) -> str:
        w = self.scenario.workers
        parts = [(n, kind) for n, kind in ((w.local, "local"), (w.processes, "process"),
                                           (getattr(w, "remote", 0), "remote")) if n]
        total = sum(n for n, _ in parts)
        plural = "s" if total != 1 else ""
        if len(parts) == 1:
            return f"{total} {parts[0][1]} worker{plural}"
        return f"{total} worker{plural} ({', '.join(f'{n} {k}' for n, k in parts)})"

    def working(self) -> float:
        """Seconds of work so far: since the run's first lease or scoring request, not
        counting the wait for workers to connect (the figures' clock); the time since
        the display started when nothing was watched."""
        working = self.in_round.snapshot().working
        return working if working > 0 else time.monotonic() - self.t0

    def _round_line(self, r: Any) -> str:
        mark = "committed" if r.committed else "kept"
        elapsed = r.elapsed or (time.monotonic() - self.t0)
        reasons = outcome_text(dict(r.reasons))
        return (f"{elapsed:8.2f}s  {self.word} {r.round:<3} v{r.version:<3} held-out "
                f"{r.heldout_reward:.3f}  {mark:<9}  {r.rollouts:>4} rollouts "
                f"{'(' + _rate(self.rollouts, self.working()) + ')':<10} "
                f"{r.proposals:>3} proposals" + (f": {reasons}" if r.proposals or r.reasons
                                                 else "") + self._carried(r))

    def _carried(self, r: Any) -> str:
        """``; held before: committed 1``: what this merge decided about diffs earlier
        rounds held for it (their round counted them ``held``), so a round that commits
        with no proposal of its own says why."""
        figures = self.in_round.fold()
        carried = next((c.carried for c in reversed(figures.closed) if c.round == r.round
                        and c.recorded), None)
        return f"; held before: {outcome_text(carried)}" if carried else ""

    def _round_line_rich(self, r: Any, prev: float | None):

        t = Text()
        t.append(f"{(r.elapsed or time.monotonic() - self.t0):7.2f}s  ", style="dim")
        t.append(f"{self.word} {r.round:<3} ", style="bold")
        t.append(f"v{r.version:<3}", style="cyan")
        t.append("held-out ")
        t.append(f"{r.heldout_reward:.3f}", style="bold green" if r.committed else "bold")
        if prev is not None and r.heldout_reward != prev:
            t.append(f" {r.heldout_reward - prev:+.3f}", style="green"
                     if r.heldout_reward > prev else "red")
        else:
            t.append("       ")
        t.append("  ")
        t.append("committed" if r.committed else "kept     ",
                 style="green" if r.committed else "dim")
        t.append(f" {r.rollouts:>4} rollouts {r.proposals:>3} proposals")
        if r.proposals or r.reasons:
            t.append(f": {outcome_text(dict(r.reasons))}", style="dim")
        t.append(self._carried(r), style="dim")
        return t

    # -- the live panel --------------------------------------------------------------------

    def budget_left(self, elapsed: float, now: RoundSnapshot | None = None) -> list[str]:
        """What is left of each budget, in words (rounds always; others when set):
        calls, tokens and cost as the Scheduler's ledger counts them, live."""
        s = self.scenario
        b = s.budgets
        done = len(self.records)
        now = now if now is not None else self.in_round.snapshot()
        out = [f"{max(0, s.rounds - done)} of {s.rounds} rounds"] if self.word == "round" else []
        if b.max_rollouts is not None:
            rollouts = max(self.rollouts, now.rollouts)
            out.append(f"{max(0, b.max_rollouts - rollouts):,} of {b.max_rollouts:,} rollouts")
        if b.max_seconds is not None:
            out.append(f"{_clock(b.max_seconds - elapsed)} of {_clock(b.max_seconds)}")
        for limit, used, what, fmt in _usage_rows(b, now):
            if limit is not None:
                out.append(f"{fmt(max(0, limit - used))} of {fmt(limit)} {what}")
        if b.patience is not None:
            out.append(f"patience {max(0, b.patience - self.since_commit)} of {b.patience}")
        if b.target_reward is not None:
            out.append(f"target {b.target_reward:.3f}")
        return out

    def used_text(self, now: RoundSnapshot) -> str:
        """``144 calls · 52,310 tokens · $0.0231``: what the run used so far (tokens
        and cost once a call reported any, or when a budget is on them)."""
        b = self.scenario.budgets
        parts = [f"{now.calls:,} calls"]
        for limit, used, what, fmt in _usage_rows(b, now)[1:]:
            if used or limit is not None:
                parts.append(f"{fmt(used)} {what}")
        return " · ".join(parts)

    @staticmethod
    def in_round_text(now: RoundSnapshot) -> str:
        """``3/4 leases done · 2/2 held-out evals``: how far the open round has got."""
        text = f"{now.leases_done}/{now.leases_planned} leases done"
        if now.evals_asked:
            text += f" · {now.evals_done}/{now.evals_asked} held-out evals"
        return text

    def eta(self, elapsed: float, now: RoundSnapshot) -> str | None:
        """Time left at most, from the pace so far over working time: the budget nearest
        its end decides (rounds, with the open round's share of leases done; rollouts;
        calls, tokens, cost; seconds). None until there is a pace to go by. The run may
        stop sooner (a target reached, patience)."""
        s, b = self.scenario, self.scenario.budgets
        shares = []
        if self.word == "round" and s.rounds:
            closed = len(self.records)
            part = closed + (now.leases_done / now.leases_planned
                             if now.leases_planned and not now.closed else 0.0)
            shares.append(part / s.rounds)
        if b.max_rollouts:
            shares.append(max(self.rollouts, now.rollouts) / b.max_rollouts)
        shares += [used / limit for limit, used, _, _ in _usage_rows(b, now) if limit]
        working = now.working if now.working > 0 else elapsed
        share = min(1.0, max(shares, default=0.0))
        if share <= 0 or working <= 0:
            return None
        left = working / share * (1.0 - share)
        if b.max_seconds is not None:
            left = min(left, max(0.0, b.max_seconds - elapsed))
        return f"at most ~{_clock(left)} left (at this pace)"

    def _panel(self):

        elapsed = time.monotonic() - self.t0
        with self._lock:
            last = self.records[-1] if self.records else None
            done = len(self.records)
            rollouts, commits, best = self.rollouts, self.commits, self.best
        now = self.in_round.snapshot()
        rollouts = max(rollouts, now.rollouts)   # answered ahead of the round's record
        if now.closes:   # the figures `inspect --summary` shows, folded live
            commits, done = now.committed, now.closes
        s = self.scenario
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="dim", justify="right", no_wrap=True)
        grid.add_column()
        width = 24
        if self.word == "round":
            part, whole, what = done, s.rounds, "rounds"
        else:  # async: no rounds; measure against the rollout budget, if any
            part, whole, what = rollouts, s.budgets.max_rollouts, "rollouts"
        filled = min(width, int(width * part / whole)) if whole else 0
        bar = Text("━" * filled, style="green")
        bar.append("━" * (width - filled), style="grey30")
        bar.append(f"  {part:,}/{whole:,} {what}" if whole else f"  {done} merges")
        bar.append(f"  ·  {_clock(elapsed)}", style="dim")
        reward = Text("-" if last is None else f"{last.heldout_reward:.3f}", style="bold")
        if last is not None:
            reward.append(f"  (v{last.version}, best {best:.3f})", style="dim")
        alive = getattr(last, "workers_alive", None) if last is not None else None
        workers = self._workers_text() if alive is None else f"{alive} alive"
        waiting = self._joined_text(now)
        if waiting is not None:
            workers += (f" · {waiting}, waiting up to "
                        f"{_clock(s.workers.wait_seconds - elapsed)} more")
        grid.add_row("progress", bar)
        if now.round is not None and not now.closed:   # async: waves, merged as they come
            open_word = "round" if self.word == "round" else "wave"
            grid.add_row(f"{open_word} {now.round}", Text(self.in_round_text(now)))
        eta = self.eta(elapsed, now)
        if eta is not None:
            grid.add_row("ETA", Text(eta))
        grid.add_row("held-out", reward)
        per = f" · {now.per_close:.1f} rollouts per {self.word}" if now.per_close else ""
        grid.add_row("commits", f"{commits} of {done} {self.word}s{per}")
        working = now.working if now.working > 0 else elapsed   # else: nothing tapped
        grid.add_row("rollouts", f"{rollouts:,}  (work starts once every worker joined)"
                     if waiting is not None else f"{rollouts:,}  ({_rate(rollouts, working)} over "
                     f"{_clock(working)} of work)")
        grid.add_row("used", Text(self.used_text(now)))
        grid.add_row("workers", workers)
        grid.add_row("budget left", Text(" · ".join(self.budget_left(elapsed, now))))
        title = Text(f" evobus run {self.source} ", style="bold")
        return Panel(grid, title=title, title_align="left", border_style="blue",
                     subtitle=Text(" Ctrl-C stops cleanly ", style="dim"),
                     subtitle_align="right", expand=False)

    def _joined_text(self, now: RoundSnapshot) -> str | None:
        """``1 of 2 joined``: while the run waits for its workers in other processes
        (before its first round: no work yet), how many registered; None otherwise."""
        w = self.scenario.workers
        elsewhere = w.processes + getattr(w, "remote", 0)
        if not elsewhere or now.working > 0 or self.records or self.quiet:
            return None   # (--quiet: no message is watched, so none is known)
        return f"{now.joined} of {elsewhere} joined"

    # -- the end -----------------------------------------------------------------------------

    def summary(self, result: Any, *, default_log: bool = False) -> None:
        """The closing lines: reward before -> after, outcomes, the log, the artifact.
        ``default_log``: the log's path was chosen by evobus (none was given)."""
        if self.quiet:
            return
        s = self.scenario
        head = (f"{s.name}: held-out reward {result.initial_reward:.3f} -> "
                f"{result.final_reward:.3f} at version {result.version} "
                f"({result.stop_reason}; {result.rollouts} rollouts in {result.elapsed:.2f} s"
                f"{self._waited(result.elapsed)})")
        lines = [f"outcomes: {outcome_text(result.outcomes())}"]
        lines += baseline_lines(self.in_round.fold())
        usage = getattr(result, "usage", None)
        if usage:
            # The agent's own count: of this process, so of a resume only since then.
            key = "tokens since the resume" if self.doing == "resuming" else "tokens"
            lines.append(f"{key}: " + ", ".join(f"{k} {v:,}" for k, v in dict(usage).items()))
        lines += budget_lines(getattr(result, "budget", None) or {})
        if result.error:
            lines.append(f"backend errors: {result.error}")
        if result.log_path:
            lines.append(f"log: {result.log_path}  (evobus inspect {result.log_path}; "
                         f"evobus report {result.log_path})")
            if default_log:
                lines.append("      (the default path: set `log` in the scenario or pass "
                             "--log to choose it)")
        if not self.live:
            self._print("\n" + head)
            for line in lines:
                self._print(line)
            self._print("\n" + result.rendered)
            return

        c = self._console
        c.print()
        style = "bold green" if result.final_reward > result.initial_reward else "bold"
        c.print(Text(head, style=style))
        for line in lines:
            key, _, rest = line.partition(": ")
            text = Text(f"{key}: ", style="dim")
            text.append(rest, style="red" if key in ("backend errors", "baseline") else "")
            c.print(text)
        c.print(Panel(Text(result.rendered), title=f"artifact v{result.version}",
                      title_align="left", border_style="dim", expand=False))

    def _waited(self, elapsed: float) -> str:
        """``, 2.10 s of work``: said when the run waited a second or more for its
        workers (the rest of ``elapsed``), so no one reads the wait as slowness."""
        working = self.in_round.snapshot().working
        if working <= 0 or elapsed - working < WAIT_WORTH_SAYING_S:
            return ""
        return f", {working:.2f} s of work after {elapsed - working:.2f} s waiting for workers"

    def interrupted(self, log_path: str | None, how: str = "interrupted") -> str:
        """The message for a run stopped with Ctrl-C, SIGTERM or SIGHUP (the caller
        prints it to stderr); ``how`` says which."""
        self.stop()
        done = len(self.records)
        waiting = self._joined_text(self.in_round.snapshot())
        what = (f"{how} after {done} {self.word}{'s' if done != 1 else ''} "
                f"({time.monotonic() - self.t0:.1f} s)" if waiting is None else
                f"{how} while waiting for workers ({waiting}, "
                f"{time.monotonic() - self.t0:.1f} s)")
        if not log_path:
            return (f"{what}; no log was written (set `log` in the scenario or pass --log), "
                    "so this run cannot be resumed")
        if not os.path.exists(log_path):
            return f"{what}, before the run started: nothing was logged, nothing to resume"
        held = ""
        try:

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                held = f" holds {len(read_log(log_path).records):,} messages and"
        except (OSError, LogCorrupt):  # the log could not be read back: say nothing of it
            held = ""
        return (f"{what}; the log {log_path}{held} is closed. Resume the run with:\n"
                f"    evobus resume {log_path}")


#: A wait for workers this long (seconds) or longer is said in the run's summary line.
WAIT_WORTH_SAYING_S = 1.0

#: How often a group's plain progress line is printed (seconds).
GROUP_LINE_EVERY_S = 5.0


class GroupProgressView(_Lines):
    """How far a group run by ``evobus run`` (or resumed by ``evobus resume``) has got:
    pass it as ``on_progress`` (it takes :class:`actors.groups.GroupProgress`) and use it
    as a context manager.

    On a terminal: a progress bar (rich) while the group runs, gone when it ends (the
    group's report follows). Elsewhere: a plain line every ``every`` seconds (default
    ``GROUP_LINE_EVERY_S``). A group that ends within a second shows neither:
    ``on_progress`` is first called after one. ``quiet`` shows nothing."""

    def __init__(self, name: str, *, stream: TextIO | None = None, quiet: bool = False,
                 live: bool | None = None, every: float | None = None) -> None:
        self.name = name
        self.stream = stream if stream is not None else sys.stdout
        self.quiet = quiet
        self.every = GROUP_LINE_EVERY_S if every is None else every
        self._last_line = 0.0
        self._bar = None
        self._task = None
        self.live = self._want_live(live, quiet)

    def __enter__(self) -> "GroupProgressView":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __call__(self, p: Any) -> None:
        if self.quiet:
            return
        if p.done:
            self.stop()
            return
        if self.live:
            self._update_bar(p)
        elif p.elapsed >= self._last_line + self.every:
            self._last_line = p.elapsed
            self._print(self.line(p))

    def line(self, p: Any) -> str:
        ended = p.finished + p.failed
        new = p.finished - p.finished_before
        rate = new / p.elapsed if p.elapsed > 0 else 0.0
        left = ""
        if rate > 0 and not p.failed:
            left = f", ~{_clock((p.total - ended) / rate)} left"
        failed = f", {p.failed} failed (stopping)" if p.failed else ""
        return (f"group {self.name}: {p.finished:,}/{p.total:,} finished "
                f"({_rate(new, p.elapsed)}){failed}, {_clock(p.elapsed)} elapsed{left}")

    def _update_bar(self, p: Any) -> None:

        if self._bar is None:
            self._bar = Progress(TextColumn(f"group {self.name}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn("{task.fields[failed]}"),
                                 TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=Console(file=self.stream, highlight=False),
                                 transient=True)
            self._bar.start()
            self._task = self._bar.add_task("group", total=p.total,
                                            completed=p.finished_before, failed="")
        self._bar.update(self._task, completed=p.finished + p.failed,
                         failed=f"{p.failed} failed" if p.failed else "")


class StepsView(_Lines):
    """What a verb that works for a while in steps is doing (``evobus report``: reading
    the log, drawing the charts): on a terminal one status line (rich, transient) that
    each step replaces, gone when the verb ends; elsewhere one plain line per step,
    flushed at once (a ``detail`` step, such as each chart, only on the terminal).
    ``quiet`` shows nothing. Pass :meth:`step` as the verb's ``step`` callback."""

    def __init__(self, verb: str, *, stream: TextIO | None = None, quiet: bool = False,
                 live: bool | None = None) -> None:
        self.verb = verb
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.live = self._want_live(live, quiet)
        self._status = None

    def __enter__(self) -> "StepsView":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def step(self, text: str, detail: bool = False) -> None:
        if self.quiet:
            return
        line = f"{self.verb}: {text}"
        if not self.live:
            if not detail:
                self._print(line)
            return
        shown = Spinner("dots", text=Text(line))
        if self._status is None:
            self._status = Live(shown, console=Console(file=self.stream, highlight=False),
                                refresh_per_second=8, transient=True)
            self._status.start()
        self._status.update(shown, refresh=True)   # each step is seen, however short


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP: the run stops as for Ctrl-C (actors closed, the log
    flushed and closed); ``signum`` gives the exit code, 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(exc: KeyboardInterrupt) -> int:
    """128 + the signal that stopped the run (130 for a plain KeyboardInterrupt)."""
    return 128 + getattr(exc, "signum", signal.SIGINT)


def stopped(progress: "RunProgress", exc: KeyboardInterrupt, log_path: str | None) -> int:
    """A run stopped by Ctrl-C, SIGTERM or SIGHUP (`evobus run`, `evobus resume`, a fork):
    say so on stderr, one message for all of them, and return the exit code (128 + the
    signal). ``log_path``: the newest log of the run (a resume that had not started its
    own yet names the log it resumes)."""
    how = "interrupted" if exit_code(exc) == 130 else f"stopped by {exc}"
    print(f"evobus: {progress.interrupted(log_path, how)}", file=sys.stderr)
    return exit_code(exc)


#: The signals that stop a run the way Ctrl-C does (SIGHUP: the terminal went away).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


@contextmanager
def interrupt_guard(stream: TextIO | None = None) -> Iterator[None]:
    """The first Ctrl-C, SIGTERM or SIGHUP raises `Interrupted` (the run stops, closing
    its actors and its log); a second one only says the run is still stopping; a third
    quits at once. A SIGTERM or SIGHUP the parent process ignores (nohup) stays
    ignored. Does nothing outside the main thread (signal handlers live there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stream = stream or sys.stderr
    presses = [0]
    active = [True]

    def again(signum: int) -> None:   # to the main thread: it wakes from a blocking wait
        if not active[0]:
            return
        if hasattr(signal, "pthread_kill"):
            signal.pthread_kill(threading.main_thread().ident, signum)
        else:   # no POSIX threads' signals: raised here, seen at the main thread's next step
            signal.raise_signal(signum)

    def on_signal(signum, frame):
        if presses[0] == 0 and _in_zmq(frame):
            # Raised inside pyzmq (a socket being made, say), the interrupt could leave a
            # socket open that nothing tracks, and closing the bus would wait for it
            # forever: the signal comes again in a moment, once out of it.
            threading.Timer(INTERRUPT_RETRY_S, again, (signum,)).start()
            return
        presses[0] += 1
        if presses[0] == 1:
            raise Interrupted(signum)
        if presses[0] == 2:
            print(f"\nevobus: still stopping (workers finishing, the log being flushed); "
                  f"{signal.Signals(signum).name} once more quits at once and risks the "
                  "log's tail", file=stream, flush=True)
            return
        print("\nevobus: quitting at once", file=stream, flush=True)
        os._exit(128 + signum)

    # A signal the parent set to be ignored stays ignored (`nohup evobus run ...` must
    # survive its terminal); SIGINT is taken over as it always was.
    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS
                if sig == signal.SIGINT or signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        active[0] = False
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: A stop signal that lands inside pyzmq comes again this much later (seconds).
INTERRUPT_RETRY_S = 0.01
#: Where pyzmq's code is (found, not imported: the CLI does not import zmq).
_ZMQ_DIRS = tuple(os.path.join(d, "") for d in getattr(
    importlib.util.find_spec("zmq"), "submodule_search_locations", None) or ())


def _in_zmq(frame) -> bool:
    """Whether ``frame`` (where the main thread was interrupted) or a caller of it is
    pyzmq's code."""
    while frame is not None:
        if frame.f_code.co_filename.startswith(_ZMQ_DIRS):
            return True
        frame = frame.f_back
    return False


def _usage_rows(b: Any, now: RoundSnapshot) -> list[tuple[Any, float, str, Any]]:
    """(limit, used, what, format) of calls, tokens and cost, as the ledger counts them."""
    return [(b.max_calls, now.calls, "calls", lambda v: f"{int(v):,}"),
            (getattr(b, "max_tokens", None), now.tokens, "tokens", lambda v: f"{int(v):,}"),
            (getattr(b, "max_cost", None), now.cost, "cost", lambda v: f"${v:,.4f}")]


def budget_lines(budget: dict) -> list[str]:
    """What the run used against its budgets, by kind: ``calls 144 of 150 (rollout 60,
    proposal 26, scoring 58)``, the same for tokens and cost when anything was used or a
    limit set, and the HTTP attempts and seconds throttled (each call's wait, summed)
    when reported."""
    if not budget:
        return []
    parts = []
    for what in ("calls", "tokens", "cost"):
        row = budget.get(what) or {}
        total, limit = row.get("total", 0), row.get("limit")
        if not total and limit is None:
            continue
        fmt = (lambda v: f"{v:,.4f}") if what == "cost" else (lambda v: f"{v:,}")
        used = fmt(total) + (f" of {fmt(limit)}" if limit is not None else "")
        kinds = ", ".join(f"{k} {fmt(row.get(k, 0))}" for k in ("rollout", "proposal", "scoring"))
        over = f", over by {fmt(row['over'])}" if row.get("over") else ""
        parts.append(f"{what} {used} ({kinds}{over})")
    lines = ["budget: " + "; ".join(parts)] if parts else []
    extra = []
    if budget.get("spent"):
        extra.append(f"{budget['spent']} spent with {budget.get('in_flight_when_spent') or 0} "
                     f"call(s) in flight; {budget.get('refused_leases', 0)} lease(s) never "
                     "started")
    if budget.get("attempts"):
        # Each call's own wait, added up: calls made at once (call_concurrency) each
        # count theirs, so it can pass the run's time.
        extra.append(f"{budget['attempts']:,} HTTP attempts, "
                     f"{budget.get('throttled_seconds', 0):.1f} s throttled (summed over "
                     "calls)")
    if budget.get("unpriced_models"):
        extra.append(f"no price for {', '.join(budget['unpriced_models'])} (cost not counted)")
    if extra:
        lines.append("budget: " + "; ".join(extra))
    return lines
