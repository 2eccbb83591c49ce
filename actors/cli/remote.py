"""CLI verbs for workers in other processes (docs/remote.md):

    evobus worker --connect tcp://HOST:PORT [--slots N] [--key FILE --server-key FILE]
                  [--allow MODULE ...] [--id NAME]
    evobus keys DIR [--client NAME ...]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from actors.cli.progress import exit_code, interrupt_guard
from actors.errors import ConfigError
from actors.groups.served import BranchService
from actors.workers.remote import PING_S, RemoteWorker, default_worker_id
from bus.security import create_keys, load_client_keys, loopback_only

log = logging.getLogger(__name__)


def _err(message: str, code: int = 2) -> int:
    print(f"evobus: {message}", file=sys.stderr)
    return code


def cmd_worker(args: argparse.Namespace) -> int:

    if bool(args.key) != bool(args.server_key):
        return _err("--key and --server-key go together: --key NAME.key_secret (this worker's "
                    "key pair) and --server-key server.key (the broker's public key)")
    keys = None
    if args.key:
        try:
            keys = load_client_keys(args.key, args.server_key)
        except ValueError as exc:
            return _err(str(exc))
    if not args.broker_timeout > PING_S:   # the endpoint pings a quiet line every second
        return _err(f"--broker-timeout {args.broker_timeout:g}: expected more than "
                    f"{PING_S:g} s (the worker pings a quiet line every {PING_S:g} s and "
                    "waits for the answer); fix: leave it out (5 s) or give a larger value")
    if not args.give_up > 0:
        return _err(f"--give-up {args.give_up:g}: expected a number of seconds > 0 (how long "
                    "the worker waits without a word from the broker before it exits)")
    if not args.connect.startswith(("tcp://", "ipc://")):
        return _err(f"--connect {args.connect!r}: expected tcp://HOST:PORT (or ipc://PATH)")
    if keys is None and args.connect.startswith("tcp://"):

        if not loopback_only(args.connect):
            log.warning("connecting to %s without CURVE keys: traffic is neither encrypted "
                        "nor authenticated (pass --key and --server-key)", args.connect)
    name = args.id or default_worker_id()
    try:
        worker = RemoteWorker(args.connect, worker_id=name, slots=args.slots,
                              allow=args.allow or [], keys=keys,
                              broker_timeout=args.broker_timeout, give_up=args.give_up,
                              say=lambda text: print(f"evobus worker {name}: {text}",
                                                     flush=True),
                              branches=BranchService)   # parallel groups' branches too
    except ConfigError as exc:
        return _err(str(exc))
    if not args.allow:
        log.warning("no --allow given: this worker will only run evobus's own strategies; "
                    "allow the modules the coordinator names (e.g. --allow scenarios)")
    try:
        with interrupt_guard():   # SIGTERM and SIGHUP leave as Ctrl-C does: slots drained
            code = worker.run()
    except KeyboardInterrupt as exc:
        how = "interrupted" if exit_code(exc) == 130 else f"stopped by {exc}"
        held = (f" after {worker.leases_done} lease(s); the coordinator re-dispatches what "
                "it still held" if worker.reached else " before it reached the broker")
        return _err(f"worker {worker.name}: {how}{held}", exit_code(exc))
    if code == 2:
        return _err(f"worker {worker.name}: refused the run: {worker.stop_reason or 'see above'}")
    if code == 1 and not worker.reached:
        return _err(f"worker {worker.name}: {worker.stop_reason}", 1)
    if code == 1:
        return _err(f"worker {worker.name}: lost the broker at {args.connect}: "
                    f"{worker.stop_reason}", 1)
    return 0


def cmd_keys(args: argparse.Namespace) -> int:


    before = {p for p in Path(args.dir).glob("*.key*")} if Path(args.dir).is_dir() else set()
    try:
        paths = create_keys(args.dir, args.client or ["client"])
    except (ValueError, OSError) as exc:
        return _err(f"keys: {exc}")
    print(f"keys in {args.dir} (existing pairs are kept, never replaced):")
    for name, path in sorted(paths.items()):
        print(f"  {name:<28} {path}" + ("  (kept)" if path in before else ""))
    clients = args.client or ["client"]
    names = " or ".join(clients) if len(clients) <= 3 else f"one of {', '.join(clients)}"
    # What each side needs, every flag in: a worker without --allow refuses the run.
    print(f"\ncoordinator: [workers] keys = \"{args.dir}\" (keep server.key_secret there); "
          "with keys it may bind any interface: bind = \"tcp://0.0.0.0:PORT\"\n"
          f"each worker: evobus worker --connect tcp://HOST:PORT --allow PKG "
          f"--key {args.dir}/NAME.key_secret --server-key {args.dir}/server.key\n"
          f"    NAME: {names} (copy its NAME.key_secret and server.key there); PKG: the "
          "modules the run names (the coordinator's waiting line says which)\n"
          f"revoke a worker: delete {args.dir}/authorized/NAME.key (from the next run)")
    return 0
