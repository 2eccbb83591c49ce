"""CLI for parallel groups: ``evobus run`` runs a scenario's ``[[groups]]`` (through
:func:`run_groups`), and ``evobus resume CHECKPOINT --answers FILE [--as NAME]`` resumes
a paused group (the verb's arguments: actors.cli.verbs).

``resume`` is shared with ``evobus resume LOG`` (actors.cli.replay): a message log
(it starts with ``EVOLOG``) goes to that verb, anything else is read as a checkpoint.

Exit codes: 0 completed, 1 failed, 2 a caller's mistake (refused), 3 paused (waiting
for answers or approvals; the checkpoint and an answers template are written).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any
from actors.errors import ConfigError
from actors.errors import ResumeRefused
from actors.groups.checkpoint import MAGIC as CHECKPOINT_MAGIC, effects_path, load_checkpoint
from actors.groups.api import checkpoint_taken, resume_group
from actors.cli.progress import GroupProgressView
from actors.workers import code as refs
from actors.groups.api import run_group
from actors.groups.fleet import elsewhere
from actors.runtime.launch import group_log_path
from actors.groups.target import _resolve_target
from actors.groups.types import output_type

log = logging.getLogger(__name__)

EXIT_PAUSED = 3


def _err(message: str) -> int:
    print(f"evobus: {message}", file=sys.stderr)
    return 2


def _is_log(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(6) == b"EVOLOG"
    except OSError:
        return False


#: What `evobus resume` takes, and where to find it, for a path that is neither.
_RESUMES = ("expected a run's message log (the `log:` line of `evobus run`'s summary, "
            "runs/NAME-YYYYmmdd-HHMMSS.evolog by default) or a parallel group's checkpoint")


def _neither_log_nor_checkpoint(path: str) -> str | None:
    """Why ``path`` cannot be resumed when it is no file, or a file that is neither a log
    nor a checkpoint by its first bytes (a scenario file, say); None when it may be a
    checkpoint (load_checkpoint then decides, an old one has no magic)."""
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as exc:
        return (f"{path}: cannot read it ({exc.strerror or exc}); {_RESUMES}; fix: pass "
                "the path of the run's log")
    if head.startswith(CHECKPOINT_MAGIC) or not head or 0x80 <= head[0] <= 0x8F \
            or head[0] in (0xDE, 0xDF):
        return None   # a checkpoint, or a bare msgpack map (one from before the magic)
    if not all(32 <= c < 127 or c in b"\t\r\n" for c in head):
        return None   # binary (a damaged checkpoint, say): load_checkpoint says what
    fix = (f"to run a scenario file, `evobus run {path}`; to continue its run, `evobus "
           "resume` the log that run wrote" if path.endswith(".toml")
           else "pass the path of the run's log")
    return f"{path}: {_RESUMES}; found a text file (it starts with {head[:6]!r}); fix: {fix}"


def _positional(args: argparse.Namespace) -> str:
    return getattr(args, "log", None) or getattr(args, "checkpoint", "")


#: `evobus resume` flags that apply to one kind of file only: (flag, its dest).
_CHECKPOINT_ONLY = (("--answers", "answers"), ("--as", "principal"), ("--show", "show"))
_LOG_ONLY = (("--log", "new_log"), ("--fsync", "fsync"))


def cmd_resume(args: argparse.Namespace, previous=None) -> int:
    path = _positional(args)
    is_log = previous is not None and _is_log(path)
    wrong = [flag for flag, dest in (_CHECKPOINT_ONLY if is_log else _LOG_ONLY)
             if getattr(args, dest, None)]
    if wrong:
        kind, other = (("a run's message log", "a group checkpoint") if is_log else
                       ("not a run's message log (it is read as a group checkpoint)",
                        "a run's message log"))
        return _err(f"{path} is {kind}: {', '.join(wrong)} only appl"
                    f"{'ies' if len(wrong) == 1 else 'y'} to {other}; remove "
                    f"{'it' if len(wrong) == 1 else 'them'}")
    if is_log:
        return previous(args)

    neither = _neither_log_nor_checkpoint(path)
    if neither is not None:
        return _err(neither)
    try:
        ckpt = load_checkpoint(path)
    except ResumeRefused as exc:
        return _err(str(exc))
    if getattr(args, "show", False):
        _show(ckpt, path)
        return 0
    if ckpt.status == "running":  # its process died mid-run: nothing to answer
        user_inputs, approvals = {}, {}
    elif not args.answers:
        _show(ckpt, path)
        return _err(f"{path}: pass --answers FILE (a JSON object {{interaction id: answer}}); "
                    f"a template: {_template_path(Path(path))}")
    else:
        try:
            user_inputs, approvals = _read_answers(args.answers, ckpt)
        except ValueError as exc:
            return _err(f"{args.answers}: {exc}")
    quiet, json_out = getattr(args, "quiet", False), getattr(args, "json", False)
    try:
        with _progress(ckpt.group_id, quiet, json_out) as view:
            outcome = resume_group(path, user_inputs=user_inputs, approvals=approvals,
                                   on_progress=view, **({"principal": args.principal}
                                                        if args.principal else {}))
    except ConfigError as exc:
        return _err(str(exc))
    return _report(outcome, name=ckpt.group_id, quiet=quiet, json_out=json_out)


def _progress(name: str, quiet: bool, json_out: bool):
    """A group's live progress: on stderr when stdout carries the JSON summary."""

    return GroupProgressView(name, stream=sys.stderr if json_out else sys.stdout,
                             quiet=quiet)


def _read_answers(path: str, ckpt) -> tuple[dict[str, Any], dict[str, bool]]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read the answers file ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object {interaction id: answer}")
    if set(data) <= {"user_inputs", "approvals"} and data:
        user_inputs = dict(data.get("user_inputs") or {})
        approvals = dict(data.get("approvals") or {})
    else:
        # A flat object: each id goes where its kind says (ask -> answer, approve -> decision).
        kinds = {p.id: p.kind for p in ckpt.pending}
        user_inputs = {k: v for k, v in data.items() if kinds.get(k) != "approve"}
        approvals = {k: v for k, v in data.items() if kinds.get(k) == "approve"}
    # null means "not answered yet": a partly filled template resumes what it can.
    user_inputs = {k: v for k, v in user_inputs.items() if v is not None}
    approvals = {k: v for k, v in approvals.items() if v is not None}
    return user_inputs, approvals


def _template_path(checkpoint: Path) -> Path:
    name = checkpoint.name[:-5] if checkpoint.name.endswith(".ckpt") else checkpoint.name
    return checkpoint.with_name(name + ".answers.json")


def _write_template(checkpoint: Path, pending) -> Path:
    path = _template_path(checkpoint)
    path.write_text(json.dumps({p.id: None for p in pending}, indent=2) + "\n",
                    encoding="utf-8")
    return path


def _show(ckpt, path: str) -> None:
    print(f"{path}: group {ckpt.group_id}, {ckpt.status}; {len(ckpt.finished)} of "
          f"{len(ckpt.items)} branches finished, {len(ckpt.not_started)} not started; "
          f"consumed {ckpt.consumed.calls} calls, {ckpt.consumed.seconds:.3f} s")
    for p in ckpt.pending:
        what = "approve" if p.kind == "approve" else "answer"
        print(f"  {p.id}  branch {p.branch}  {what}: {p.prompt}")
    if ckpt.approvers:
        print(f"  approvers: {', '.join(ckpt.approvers)}")


#: A completed group's report lists this many results (``--json`` gives them all).
SHOW_RESULTS = 20


def _report(outcome, *, name: str, quiet: bool, json_out: bool) -> int:
    if json_out:
        print(json.dumps({
            "group": name, "status": outcome.status, "results": outcome.results,
            "error": None if outcome.error is None else
            f"{type(outcome.error).__name__}: {outcome.error}",
            "pending": [{"id": p.id, "branch": p.branch, "kind": p.kind, "prompt": p.prompt}
                        for p in outcome.pending_interactions],
            "checkpoint": str(outcome.checkpoint) if outcome.checkpoint else None,
            "finished": len(outcome.finished), "failed": outcome.failed,
            "cancelled": outcome.cancelled, "never_started": outcome.never_started,
            "effects": len(outcome.effects), "store": outcome.store,
            "consumed": {"calls": outcome.consumed.calls,
                         "seconds": outcome.consumed.seconds, "cost": outcome.consumed.cost},
        }, default=str))
    if outcome.status == "completed":
        if not quiet and not json_out:
            print(f"group {name}: completed, {len(outcome.results)} results "
                  f"({outcome.stats.get('elapsed', 0):.3f} s, {len(outcome.effects)} effects)")
            shown = outcome.results[:SHOW_RESULTS]
            for r in shown:
                print(f"  {json.dumps(r, default=str)}")
            if len(outcome.results) > len(shown):
                print(f"  ... {len(outcome.results) - len(shown):,} more (--json prints every "
                      "result)")
            if outcome.store:
                print(f"  store: {json.dumps(outcome.store, default=str, sort_keys=True)}")
        return 0
    if outcome.status == "failed":
        print(f"evobus: group {name} failed at branch {outcome.error_branch}: "
              f"{type(outcome.error).__name__}: {outcome.error} (finished "
              f"{len(outcome.finished)}, failed {len(outcome.failed)}, cancelled "
              f"{len(outcome.cancelled)}, never started {len(outcome.never_started)}"
              + (f", {len(outcome.effects)} effects performed, not undone" if outcome.effects
                 else "") + ")", file=sys.stderr)
        return 1
    template = _write_template(Path(outcome.checkpoint), outcome.pending_interactions)
    if not json_out:
        print(f"group {name}: paused ({outcome.status}); {len(outcome.finished)} finished, "
              f"{len(outcome.pending_interactions)} waiting:")
        for p in outcome.pending_interactions:
            what = "approve" if p.kind == "approve" else "answer"
            print(f"  {p.id}  branch {p.branch}  {what}: {p.prompt}")
        print(f"checkpoint: {outcome.checkpoint}\nanswers template: {template} (fill in, "
              f"then: evobus resume {outcome.checkpoint} --answers {template}"
              + (" --as NAME" if any(p.kind == "approve" for p in outcome.pending_interactions)
                 else "") + ")")
    return EXIT_PAUSED


def _remove_checkpoint(path: Path) -> None:
    """``--overwrite``: a new group replaces what a checkpoint path holds (a paused
    group's checkpoint and its effect journal, which a new group would otherwise refuse)."""
    for gone in (path, effects_path(path)):
        try:
            gone.unlink()
        except FileNotFoundError:   # nothing there: nothing to replace
            pass


def _items_of(spec, where: str) -> list[Any]:

    if isinstance(spec.items, list):
        return spec.items
    items = refs.resolve(spec.items, None, what=f"{where}.items")
    return list(items() if callable(items) else items)


def checkpoint_path(scenario, spec) -> str:
    """Where a scenario's group writes its checkpoint: its ``checkpoint``, else
    ``runs/SCENARIO.GROUP.ckpt``."""
    return spec.checkpoint or f"runs/{scenario.name}.{spec.name}.ckpt"


def check_groups(scenario, source: str, *, overwrite: bool = False) -> str | None:
    """What ``evobus validate`` checks of each group before anything runs: its target
    resolves, and declares its output type (a return annotation or ``returns``); its
    checkpoint path holds no group that has not ended (unless ``--overwrite``)."""
    for i, spec in enumerate(scenario.groups):
        where = f"{source}: at `$.groups[{i}]` ({spec.name})"
        try:
            fn, _ = _resolve_target(spec.target, None)
            output_type(fn, spec.returns, "the group")
        except ConfigError as exc:
            return f"{where}: {exc}"
        taken = None if overwrite else checkpoint_taken(Path(checkpoint_path(scenario, spec)))
        if taken is not None:
            return f"{where}: {taken}"
    return None


def run_groups(scenario, source: str, *, quiet: bool = False, json_out: bool = False,
               log_path: str | None = None, overwrite: bool = False) -> int:
    """Run every ``[[groups]]`` entry of a scenario, one after the other; the exit code
    of the worst outcome (failed 1 > paused 3 > completed 0; a refusal is 2)."""

    worst = 0
    rank = {0: 0, EXIT_PAUSED: 1, 1: 2, 2: 3}
    for i, spec in enumerate(scenario.groups):
        where = f"$.groups[{i}]"
        checkpoint = checkpoint_path(scenario, spec)
        options: dict[str, Any] = {}
        if spec.approvers is not None:
            options["approvers"] = list(spec.approvers)
        if spec.returns is not None:
            options["returns"] = spec.returns
        if elsewhere(scenario.workers):   # branches on the [workers] section's processes
            options["workers"] = scenario.workers
        if log_path:
            options["log"] = group_log_path(log_path, spec.name)
            if overwrite:
                options["log_overwrite"] = True
        if overwrite:   # a paused group's checkpoint there is replaced, as asked
            _remove_checkpoint(Path(checkpoint))
        try:
            items = _items_of(spec, where)
            with _progress(spec.name, quiet, json_out) as view:
                outcome = run_group(spec.target, items,
                                    max_concurrency=spec.max_concurrency,
                                    max_items=spec.max_items, checkpoint=checkpoint,
                                    on_progress=view, **options)
        except ConfigError as exc:
            code = _err(f"{source}: at `{where}` ({spec.name}): {exc}")
        else:
            code = _report(outcome, name=spec.name, quiet=quiet, json_out=json_out)
        if rank[code] > rank[worst]:
            worst = code
    return worst
