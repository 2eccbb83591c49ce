"""A run report from a message log: one self-contained HTML page (charts embedded as
PNG data) plus the PNGs themselves. ``evobus report LOG [-o DIR]``.

What it shows, all read back from the log (nothing is sampled or estimated):

- the held-out reward over time: the head's score after every round (or merge),
  commits marked, and every candidate the merger scored as a faint dot;
- a timeline per worker: when it held a lease (a rollout, an eval, a group branch),
  when it was *starved* (free while other workers still held leases: waiting at the
  barrier on stragglers, or held back by ``max_concurrency``) and when it was *idle*
  (free while no lease was out anywhere: the merger or planner was deciding);
  re-dispatched leases are marked;
- outcome counts (committed, conflict, duplicate, below-threshold, ...), late answers
  dropped, re-dispatches, and a table of rounds.

:func:`~actors.cli.analysis.analyse` is pure (no matplotlib); :func:`charts` needs matplotlib (the
``report`` extra); :func:`write_report` does both and writes the files.
"""

from __future__ import annotations

import base64
import html
import importlib.util
import io
import time
from pathlib import Path
from typing import Any, Callable

from actors.cli.analysis import RunAnalysis, analyse, worker_states
from actors.cli.learned import SOLVED, Learned, failing_groups
from bus.log import read_header

__all__ = ["MissingExtra", "OutputError", "RunAnalysis", "analyse", "charts", "render_html", "write_report"]

INSTALL_HINT = 'pip install "evobus[report]"'
#: The timeline draws at most this many workers (the rest are counted in the caption).
MAX_TIMELINE_WORKERS = 48


class MissingExtra(ImportError):
    """matplotlib is not installed; the message names the extra to install."""


# -- charts ---------------------------------------------------------------------------------

COLOURS = {
    "busy-rollout": "#2b7bba", "busy-eval": "#7fb3d5", "busy-branch": "#8e6bbf",
    "busy-waiting": "#d6c4ec",
    "starved": "#f0a04b", "idle": "#e3e3e3", "redispatch": "#d62728",
    "committed": "#2ca02c", "kept": "#9e9e9e", "head": "#1f4e79", "candidate": "#b0b0b0",
}
OUTCOME_COLOURS = {"committed": "#2ca02c", "rollout-error": "#d62728",
                   "section-violation": "#d62728", "conflict": "#f0a04b",
                   "below-threshold": "#9e9e9e", "duplicate": "#c7c7c7",
                   "unchanged": "#c7c7c7"}


def _matplotlib():
    try:  # an optional extra (evobus[report]): imported only when a chart is drawn
        import matplotlib
    except ImportError:
        raise MissingExtra(f"the report draws its charts with matplotlib, which is not "
                           f"installed: {INSTALL_HINT}") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


#: What each chart draws, for the progress of `evobus report` (on a terminal).
CHART_NAMES = {"reward": "the held-out reward", "timeline": "the workers' timeline",
               "outcomes": "the outcome counts"}


def charts(a: RunAnalysis, on_chart: Callable[[str, int, int], None] | None = None
           ) -> dict[str, bytes]:
    """PNG bytes per chart: ``timeline``, and for an evolve run ``reward`` and
    ``outcomes`` (a log of parallel groups alone has neither). ``on_chart(name, i, n)``
    is told as the i-th of n charts begins."""
    plt = _matplotlib()
    out: dict[str, bytes] = {}
    plt.rcParams.update({"font.size": 9, "axes.spines.top": False,
                         "axes.spines.right": False})
    draw = [("reward", _reward_chart)] if a.evolves else []
    draw += [("timeline", _timeline_chart)]
    draw += [("outcomes", _outcome_chart)] if a.evolves else []
    try:
        for i, (name, chart) in enumerate(draw, 1):
            if on_chart is not None:
                on_chart(name, i, len(draw))
            out[name] = chart(plt, a)
    finally:
        plt.close("all")
    return out


def _reward_chart(plt, a: RunAnalysis) -> bytes:
    fig, ax = plt.subplots(figsize=(9, 3.4))
    word = "merge" if a.mode == "async" else "round"
    if a.candidates:
        ax.scatter([t for t, _ in a.candidates], [s for _, s in a.candidates], s=9,
                   color=COLOURS["candidate"], alpha=0.6, label="candidate scored", zorder=1)
    xs, ys = [], []
    if a.baseline is not None:
        xs.append(a.baseline[0])
        ys.append(a.baseline[1])
    for r in a.rounds:
        xs.append(r.t)
        ys.append(r.heldout)
    if xs:
        xs.append(max(a.duration, xs[-1]))
        ys.append(ys[-1])
        ax.step(xs, ys, where="post", color=COLOURS["head"], lw=2, label="head (held-out)",
                zorder=2)
    if a.baseline is not None:
        ax.scatter([a.baseline[0]], [a.baseline[1]], marker="s", color=COLOURS["head"],
                   s=28, zorder=3, label="version 0")
    committed = [r for r in a.rounds if r.committed]
    kept = [r for r in a.rounds if not r.committed]
    if committed:
        ax.scatter([r.t for r in committed], [r.heldout for r in committed],
                   color=COLOURS["committed"], s=36, zorder=4, label=f"{word} committed")
    if kept:
        ax.scatter([r.t for r in kept], [r.heldout for r in kept], facecolors="white",
                   edgecolors=COLOURS["kept"], s=30, zorder=4, label=f"{word} kept head")
    if len(a.rounds) <= 20:
        for r in a.rounds:
            ax.annotate(f"{'v' + str(r.version) if r.committed else ''}", (r.t, r.heldout),
                        textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7,
                        color=COLOURS["committed"])
    ax.set_ylim(-0.04, 1.08)
    ax.set_xlim(left=0)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("held-out reward")
    ax.grid(axis="y", color="#eeeeee")
    if xs or a.candidates:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, frameon=False,
                  ncol=5)
    else:
        ax.text(0.5, 0.5, "no held-out score in this log", ha="center", va="center",
                transform=ax.transAxes, color="#777777")
    fig.tight_layout()
    return _png(fig)


def _timeline_chart(plt, a: RunAnalysis) -> bytes:
    from matplotlib.patches import Patch

    workers = a.workers[:MAX_TIMELINE_WORKERS]
    n = max(1, len(workers))
    fig, ax = plt.subplots(figsize=(9, 1.1 + 0.32 * n))
    used: set[str] = set()
    for i, w in enumerate(workers):
        pieces, _ = worker_states(a, w)
        by_state: dict[str, list[tuple[float, float]]] = {}
        for state, s0, s1 in pieces:
            if s1 > s0:
                by_state.setdefault(state, []).append((s0, s1 - s0))
        for state, bars in by_state.items():
            busy = state.startswith("busy")  # a thin edge shows where one lease ends
            ax.broken_barh(bars, (i - 0.38, 0.76), facecolors=COLOURS.get(state, "#555555"),
                           edgecolor="white" if busy else "none", linewidth=0.4 if busy else 0)
            used.add(state)
        redo = [s.start for s in a.spans if s.worker == w and s.redispatch]
        if redo:
            ax.scatter(redo, [i] * len(redo), marker="v", color=COLOURS["redispatch"],
                       s=30, zorder=3)
            used.add("redispatch")
    ax.set_yticks(range(len(workers)))
    ax.set_yticklabels(workers)
    ax.set_ylim(n - 0.5, -0.5)
    start = min((a.lifetimes[w][0] for w in workers), default=0.0)
    span = max(a.duration - start, 1e-6)
    ax.set_xlim(max(0.0, start - 0.02 * span), start + 1.01 * span)
    ax.set_xlabel("seconds since the run started")
    if not workers:
        ax.text(0.5, 0.5, "no worker held a lease in this log", ha="center", va="center",
                transform=ax.transAxes, color="#777777")
    for r in a.rounds if len(a.rounds) <= 60 else []:
        ax.axvline(r.t, color="#333333", lw=0.8, ls=":", alpha=0.7, zorder=2)
    labels = {"busy-rollout": "busy: rollout", "busy-eval": "busy: held-out eval",
              "busy-branch": "busy: group branch",
              "busy-waiting": "holding a branch, waiting on a person",
              "starved": "starved (others busy)",
              "idle": "idle (no lease out)", "redispatch": "re-dispatched lease"}
    handles = [Patch(color=COLOURS[k], label=v) for k, v in labels.items() if k in used]
    if handles:
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.5 / n - 0.18),
                  ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout()
    return _png(fig)


def _outcome_chart(plt, a: RunAnalysis) -> bytes:
    items = sorted(a.outcomes.items(), key=lambda kv: (-kv[1], kv[0]))
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.32 * max(1, len(items))))
    if items:
        names = [k for k, _ in items]
        values = [v for _, v in items]
        bars = ax.barh(names, values, color=[OUTCOME_COLOURS.get(k, "#7f7f7f") for k in names])
        ax.bar_label(bars, padding=3, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("count")
        ax.set_xlim(0, max(values) * 1.12)
    else:
        ax.set_yticks([])
        ax.text(0.5, 0.5, "no proposal was merged in this log", ha="center", va="center",
                transform=ax.transAxes, color="#777777")
    fig.tight_layout()
    return _png(fig)


# -- the page -------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;
 max-width:1000px;margin:24px auto;padding:0 16px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #ddd;
 padding-bottom:3px}.sub{color:#666;margin:0 0 14px}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:120px}
.card b{display:block;font-size:19px}.card span{color:#666;font-size:12px}
.good b{color:#2ca02c}.warn b{color:#d62728}
img{max-width:100%;border:1px solid #eee}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border-bottom:1px solid #eee;padding:3px 10px;text-align:right}
th{background:#fafafa}td:first-child,th:first-child{text-align:left}
td.l,th.l{text-align:left}.note{color:#666;font-size:12.5px}
code{background:#f4f4f4;padding:1px 4px;border-radius:3px}
pre{background:#f7f7f7;border:1px solid #e5e5e5;padding:8px 10px;white-space:pre-wrap;
 overflow-wrap:anywhere;font-size:12.5px}
td.old{color:#a33;text-decoration:line-through}td.new{color:#176b1f}
details summary{cursor:pointer;margin:4px 0}
"""


def _secs(v: float) -> str:
    if v >= 10:
        return f"{v:,.1f} s"
    if v >= 0.1 or v == 0:
        return f"{v:.2f} s"
    return f"{v * 1000:.1f} ms"


def _number(v: Any) -> str:
    if isinstance(v, (int, float)) and float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.3f}" if isinstance(v, float) else html.escape(str(v))


def _card(value: str, label: str, cls: str = "") -> str:
    return (f'<div class="card {cls}"><b>{html.escape(value)}</b>'
            f'<span>{html.escape(label)}</span></div>')


def _img(pngs: dict[str, bytes], name: str, alt: str) -> str:
    if name not in pngs:
        return ""
    data = base64.b64encode(pngs[name]).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def render_html(a: RunAnalysis, pngs: dict[str, bytes]) -> str:
    """The report page: everything inline (CSS, images), no script, no network."""
    word = "merge" if a.mode == "async" else "round"
    parts = (_head_html(a) + _warnings_html(a)
             + (_learned_html(a) if a.evolves and a.learned is not None else [])
             + _reward_html(a, pngs, word) + _groups_html(a) + _workers_html(a, pngs, word)
             + _outcomes_html(a, pngs) + _stats_html(a) + _rounds_html(a, word)
             + _footer_html(a))
    return "\n".join(p for p in parts if p)


def _cards_html(a: RunAnalysis, word: str) -> list[str]:
    reward = "-"
    if a.initial_reward is not None and a.final_reward is not None:
        reward = f"{a.initial_reward:.3f} → {a.final_reward:.3f}"
    commits = sum(r.committed for r in a.rounds)
    cards = []
    if a.evolves:
        rollouts = a.rollouts if a.rollouts is not None else sum(r.rollouts for r in a.rounds)
        cards += [
            _card(reward, "held-out reward", "good" if (a.final_reward or 0) >
                  (a.initial_reward or 0) else ""),
            _card(f"{commits} / {len(a.rounds)}", f"{word}s committed"),
            _card(f"{rollouts:,}", "rollouts")]
    if a.groups:
        items = sum(g["items"] for g in a.groups.values())
        finished = sum(g["finished"] for g in a.groups.values())
        waiting = sum(g["waiting"] for g in a.groups.values())
        cards += [_card(f"{finished} / {items}", "group items finished"),
                  _card(str(waiting), "waiting on a person", "warn" if waiting else "")]
    stop = a.stop_reason or ", ".join(sorted({g["status"] for g in a.groups.values()}))
    cards += [
        _card(_secs(a.duration), "duration"),
        _card(str(len(a.workers)), "workers"),
        _card(str(a.redispatches), "re-dispatches", "warn" if a.redispatches else ""),
        _card(str(a.late_answers), "late answers dropped", "warn" if a.late_answers else ""),
        _card(stop if a.complete else "did not finish",
              "group status" if a.groups and not a.evolves else "stop reason",
              "" if a.complete else "warn"),
    ]
    return cards


def _head_html(a: RunAnalysis) -> list[str]:
    h = a.header
    e = html.escape
    word = "merge" if a.mode == "async" else "round"
    title = f"evobus run report: {h.scenario or Path(a.path).name}"
    cards = _cards_html(a, word)
    parts = [f"<!doctype html><html lang=en><head><meta charset=utf-8>"
             f"<meta name=viewport content='width=device-width,initial-scale=1'>"
             f"<title>{e(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{e(title)}</h1>",
             f"<p class=sub>log <code>{e(a.path)}</code> · run {e(h.run_id or '-')} · seed "
             f"{h.seed} · started {e(h.started_at or '-')} · evobus {e(h.package_version or '?')}"
             f" · {a.records:,} messages · {a.mode} mode</p>",
             f"<div class=cards>{''.join(cards)}</div>"]
    return parts


def _warnings_html(a: RunAnalysis) -> list[str]:
    e = html.escape
    parts: list[str] = []
    warn = []
    if not a.complete:
        warn.append("The log ends before the run's result (interrupted or crashed): what is "
                    "shown is the run up to its last message.")
    if a.dropped_tail:
        warn.append(f"A torn tail of {a.dropped_tail} bytes was cut off when reading the log.")
    if a.undecodable:
        warn.append(f"{a.undecodable} message(s) could not be decoded (written by a newer "
                    "evobus?) and are left out.")
    for w in warn:
        parts.append(f"<p class=note>⚠ {e(w)}</p>")
    if len(a.segments) > 1:
        parts.append(f"<p class=note>A resumed run: {len(a.segments)} logs, shown as one "
                     "run (" + " → ".join(f"<code>{e(p)}</code>" for p in a.segments)
                     + ").</p>")
    return parts


def _reward_html(a: RunAnalysis, pngs: dict[str, bytes], word: str) -> list[str]:
    if not a.evolves:
        return []
    return ["<h2>Held-out reward over time</h2>",
              "<p class=note>The head's held-out score after each "
              f"{word}; green: a new version was committed; grey dots: every candidate "
              "the merger scored on the held-out tasks"
              + (f" ({a.other_evals} re-verifications on a proposal's own task are not "
                 "drawn)" if a.other_evals else "") + ".</p>",
              _img(pngs, "reward", "held-out reward over time")]


def _groups_html(a: RunAnalysis) -> list[str]:
    e = html.escape
    parts: list[str] = []
    if a.groups:
        parts.append("<h2>Parallel groups</h2><table><tr><th>group</th><th>items</th>"
                     "<th>at most at once</th><th>leases</th><th class=l>status</th>"
                     "<th>finished</th><th>failed</th><th>waiting on a person</th></tr>")
        for gid, g in a.groups.items():
            parts.append(f"<tr><td>{e(gid)}</td><td>{g['items']}</td><td>{g['bound']}</td>"
                         f"<td>{g['leases']}</td><td class=l>{e(g['status'])}</td>"
                         f"<td>{g['finished']}</td><td>{g['failed']}</td>"
                         f"<td>{g['waiting']}</td></tr>")
        parts.append("</table>")
    return parts


def _workers_html(a: RunAnalysis, pngs: dict[str, bytes], word: str) -> list[str]:
    e = html.escape
    parts: list[str] = []
    if a.mode == "async":
        starved = "no work for it: the wave ran dry, or backpressure held new leases back"
    elif a.evolves:
        starved = "waiting at the barrier on stragglers, or held back by max_concurrency"
    else:
        starved = "the group's bound was reached, or no item was left to start"
    parts += ["<h2>Workers over time</h2>",
              "<p class=note><b>busy</b>: holding a lease (rollouts, held-out evals, group "
              f"branches). <b>starved</b>: free while other workers still held leases "
              f"({starved}). <b>idle</b>: free while no lease was out anywhere (the "
              "control actors deciding)." + (f" Dotted lines: {word} closes." if a.rounds
                                             else "")
              + " Red marks: a lease dispatched again.</p>",
              _img(pngs, "timeline", "per-worker timeline")]
    if len(a.workers) > MAX_TIMELINE_WORKERS:
        parts.append(f"<p class=note>The chart shows the first {MAX_TIMELINE_WORKERS} of "
                     f"{len(a.workers)} workers; the table below lists all of them.</p>")
    parts.append("<table><tr><th>worker</th><th>leases</th><th>re-dispatched to it</th>"
                 "<th>busy</th><th>starved</th><th>idle</th></tr>")
    for w in a.workers:
        t = a.worker_time(w)
        life = max(1e-9, sum(t.values()))
        leases = len({s.lease_id for s in a.spans if s.worker == w})
        redo = sum(1 for s in a.spans if s.worker == w and s.redispatch)
        parts.append(f"<tr><td>{e(w)}</td><td>{leases}</td><td>{redo}</td>" + "".join(
            f"<td>{_secs(t.get(k, 0.0))} ({100 * t.get(k, 0.0) / life:.0f}%)</td>"
            for k in ("busy", "starved", "idle")) + "</tr>")
    parts.append("</table>")
    return parts


def _outcomes_html(a: RunAnalysis, pngs: dict[str, bytes]) -> list[str]:
    e = html.escape
    parts: list[str] = []
    if a.evolves:
        parts += ["<h2>Outcomes</h2>",
                  "<p class=note>What became of every proposal: committed, or discarded as "
                  "a duplicate, unchanged, the loser of a conflict, below the held-out "
                  "threshold, outside its section; rollout-error counts failed rollouts.</p>",
                  _img(pngs, "outcomes", "outcome counts")]
    else:
        parts.append("<h2>Leases</h2>")
    parts.append("<table><tr><th>outcome</th><th>count</th></tr>" + "".join(
        f"<tr><td>{e(k)}</td><td>{v:,}</td></tr>"
        for k, v in sorted(a.outcomes.items(), key=lambda kv: (-kv[1], kv[0])))
        + f"<tr><td>re-dispatched leases</td><td>{a.redispatches}</td></tr>"
        f"<tr><td>late answers dropped</td><td>{a.late_answers}</td></tr></table>")
    return parts


def _stats_html(a: RunAnalysis) -> list[str]:
    e = html.escape
    parts: list[str] = []
    if a.stats:
        parts.append("<h2>Run statistics</h2><table><tr><th class=l>statistic</th>"
                     "<th>value</th></tr>" + "".join(
                         f"<tr><td class=l>{e(STAT_NAMES.get(k, k))} <span class=note>"
                         f"({e(k)})</span></td><td>{_number(v)}</td></tr>"
                         for k, v in sorted(a.stats.items())) + "</table>")
    return parts


def _rounds_html(a: RunAnalysis, word: str) -> list[str]:
    e = html.escape
    parts: list[str] = []
    if a.rounds:
        parts.append(f"<h2>{word.capitalize()}s</h2><table><tr><th>{word}</th>"
                     "<th>closed at</th><th>version</th><th>committed</th><th>held-out</th>"
                     "<th>rollouts</th><th>proposals</th><th class=l>outcomes</th></tr>")
        for r in a.rounds:
            outcomes = ", ".join(f"{k} {v}" for k, v in sorted(r.outcomes.items())) or "-"
            parts.append(f"<tr><td>{r.round}</td><td>{r.t:.2f} s</td><td>v{r.version}</td>"
                         f"<td>{'yes' if r.committed else 'no'}</td><td>{r.heldout:.3f}</td>"
                         f"<td>{r.rollouts}</td><td>{r.proposals}</td>"
                         f"<td class=l>{e(outcomes)}</td></tr>")
        parts.append("</table>")
    return parts


def _footer_html(a: RunAnalysis) -> list[str]:
    e = html.escape
    parts: list[str] = []
    parts.append("<h2>Messages</h2><p class=note>" + e(", ".join(
        f"{k} {v:,}" for k, v in a.kinds.most_common())) + "</p>")
    parts.append(f"<p class=note>Made by <code>evobus report {e(a.path)}</code>. Inspect "
                 f"the messages with <code>evobus inspect {e(a.path)}</code>.</p></body></html>")
    return parts


#: Run statistics (RunDone.stats, EvolveResult.stats) in plain words.
STAT_NAMES = {
    "reverified": "stale proposals re-scored on their own task before merging",
    "stall_refreshes": "times every worker was refreshed after merges without a commit",
    "max_eta_kept": "most versions behind the head a merged proposal was",
    "starved_seconds": "worker-seconds held back by backpressure",
    "held_back": "leases held back by backpressure",
    "refreshes": "worker snapshot refreshes",
    "cancelled_leases": "leases cancelled",
    "scoring_calls": "backend calls spent scoring candidates on held-out tasks",
}


def _pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def _short(text: str | None, n: int = 160) -> str:
    if text is None:
        return "—"
    return text if len(text) <= n else text[: n - 1] + "…"


def _learned_html(a: RunAnalysis) -> list[str]:
    """The artifact, what each commit changed (and on what evidence), the tasks the head
    still fails, and the artifact at every version."""
    e = html.escape
    learned, render = a.learned, a.render
    head = learned.head
    if head is None:
        return []
    out = [f"<h2>The artifact (v{head.version})</h2>", _pre(render(head.state))]
    commits = [v for v in learned.versions if v.version > 0]
    out.append("<h2>What each commit changed</h2>")
    if not commits:
        out.append("<p class=note>No commit: the artifact is still the initial one.</p>")
    else:
        out.append("<p class=note>Each key a commit changed, the worker whose rollout "
                   "proposed it and on which task, and the held-out score the new version "
                   "had to beat (before) and reached (after).</p><table class=commits><tr>"
                   "<th>version</th><th class=l>when</th><th>held-out before → after</th>"
                   "<th class=l>key</th><th class=l>before</th><th class=l>after</th>"
                   "<th class=l>proposed by</th></tr>")
    for v in commits:
        when = f"{learned.word} {v.round}" if v.round is not None else f"{v.t:.2f} s"
        wave = "wave" if learned.word == "merge" else "round"
        evidence = f"{_score(v.previous_heldout)} → {_score(v.heldout)}"
        for i, edit in enumerate(v.edits or [None]):
            lead = (f"<td>v{v.version}</td><td class=l>{e(when)}</td><td>{evidence}</td>"
                    if i == 0 else "<td></td><td></td><td></td>")
            if edit is None:
                out.append(f"<tr>{lead}<td class=l colspan=4>(no key changed)</td></tr>")
                continue
            who = (f"{edit.worker} on <code>{e(edit.task or '?')}</code> ({wave} {edit.round})"
                   if edit.worker else "not found in the log")
            out.append(f"<tr>{lead}<td class=l><code>{e(edit.key)}</code></td>"
                       f"<td class='l old'>{e(_short(edit.before))}</td>"
                       f"<td class='l new'>{e(_short(edit.after))}</td>"
                       f"<td class=l>{who}</td></tr>")
    if commits:
        out.append("</table>")
    out += _failing_html(learned)
    out.append("<h2>The artifact at every version</h2>")
    for v in reversed(learned.versions):
        label = f"v{v.version}" + (f" ({learned.word} {v.round})" if v.round is not None
                                   else "") \
            + f", held-out {_score(v.heldout)}"
        out.append(f"<details{' open' if v is head else ''}><summary>{e(label)}</summary>"
                   f"{_pre(render(v.state))}</details>")
    return out


def _score(x: float | None) -> str:
    return "—" if x is None else f"{x:.3f}"


def _failing_html(learned: Learned) -> list[str]:
    """The tasks the head still fails: counted per group with examples where the domain
    groups its tasks, then every one of them."""
    e = html.escape
    head, failing = learned.head, learned.failing()
    out = [f"<h2>Tasks the head still fails ({len(failing)})</h2>"]
    if not failing:
        return out + [f"<p class=note>None: v{head.version} scores at least {SOLVED} on "
                      "every held-out task it was scored on and every training task it "
                      "was rolled out on.</p>"]
    by, groups = failing_groups(learned)
    rows = "".join(f"<tr><td class=l><code>{e(t)}</code></td><td class=l>{e(split)}</td>"
                   f"<td>{score:.3f}</td></tr>" for split, t, score in failing)
    table = ("<table class=failing><tr><th class=l>task</th><th class=l>split</th>"
             f"<th>score</th></tr>{rows}</table>")
    if by is None:
        return out + [table]
    out.append(f"<p class=note>Grouped by the tasks' <code>{e(by)}</code>: per group, the "
               "tasks v{0} fails of those it was scored on (held-out, and training tasks "
               "rolled out at this version), and a few of them.</p>".format(head.version))
    out.append("<table class=failing-groups><tr><th class=l>group</th><th>failing</th>"
               "<th>of scored</th><th class=l>for example</th></tr>" + "".join(
                   f"<tr><td class=l>{e(g.group)}</td><td>{len(g.failing)}</td>"
                   f"<td>{g.scored}</td><td class=l>" + ", ".join(
                       f"<code>{e(t)}</code> ({e(split)} {score:.2f})"
                       for split, t, score in g.failing[:3]) + "</td></tr>"
                   for g in groups) + "</table>")
    return out + [f"<details><summary>every failing task ({len(failing)})</summary>"
                  f"{table}</details>"]


def default_dir(log: str | Path) -> Path:
    """``runs/router.evolog`` -> ``runs/router-report``."""
    log = Path(log)
    return log.with_name(f"{log.stem}-report")


class OutputError(OSError):
    """The report's directory or files cannot be written (the log is not to blame)."""


def write_report(log: str | Path, out_dir: str | Path | None = None,
                 step: Callable[..., None] | None = None) -> Path:
    """Write ``index.html`` and the PNGs into ``out_dir``; return the HTML's path.
    Raises :class:`MissingExtra` before reading anything when matplotlib is missing,
    :class:`OutputError` when ``out_dir`` cannot be written (checked before the log is
    read), OSError / LogCorrupt when the log cannot be read. ``step(text, detail=)``
    is told what it does as it goes (actors.cli.progress.StepsView): reading the log,
    what it holds, each chart (a detail), writing the page."""
    step = step or (lambda text, detail=False: None)
    if importlib.util.find_spec("matplotlib") is None:
        _matplotlib()   # raises MissingExtra, naming the extra
    out = Path(out_dir) if out_dir is not None else default_dir(log)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(exc.errno, f"cannot create the report directory {out} "
                          f"({exc.strerror or exc})") from None
    read_header(log)   # a file that is no log is refused before anything is said
    t0 = time.monotonic()
    step(f"reading {log} ({_size(Path(log).stat().st_size)})")
    a = analyse(log)
    things = [(a.records, "record"), (len(a.segments), "log") if len(a.segments) > 1
              else None, (len(a.workers), "worker"), (len(a.spans), "lease"),
              (len(a.rounds), "merge" if a.mode == "async" else "round") if a.rounds
              else None]
    read = ", ".join(f"{n:,} {what}{'s' if n != 1 else ''}" for n, what in filter(None, things))
    step(f"{read} read in {time.monotonic() - t0:.1f} s; drawing the charts")
    pngs = charts(a, lambda name, i, n: step(
        f"drawing {CHART_NAMES[name]} ({i} of {n})", detail=True))
    page = out / "index.html"
    step(f"writing {page}", detail=True)
    try:
        for name, data in pngs.items():
            (out / f"{name}.png").write_bytes(data)
        page.write_text(render_html(a, pngs), encoding="utf-8")
    except OSError as exc:
        raise OutputError(exc.errno, f"cannot write the report into {out} "
                          f"({exc.strerror or exc})") from None
    return page


def _size(n: int) -> str:
    """``725 KB``, ``6.5 MB``: a file's size for a progress line."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:,.0f} {unit}"
    return f"{n} B"
