"""CURVE keys for remote workers: made by ``evobus keys DIR``, loaded by both sides.

A key directory holds (ZeroMQ certificate files, written by ``zmq.auth``)::

    DIR/server.key          the broker's public key: give it to every worker (--server-key)
    DIR/server.key_secret   the broker's secret key: stays on the coordinator
    DIR/NAME.key            a client's public key
    DIR/NAME.key_secret     a client's secret key: copy it to that worker (--key)
    DIR/authorized/NAME.key the public keys the broker accepts (delete one and restart
                            the coordinator to revoke it)

The broker side runs pyzmq's :class:`~zmq.auth.thread.ThreadAuthenticator` over
``DIR/authorized``: a peer whose public key is not there completes no handshake and
gets nothing. Secret files are written with mode 0600.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

SERVER = "server"
AUTHORIZED = "authorized"
#: The ZAP domain the broker's peer sockets authenticate in.
ZAP_DOMAIN = b"evobus"


class KeyFileError(ValueError):
    """A key file or directory is missing or malformed; the message names the fix."""


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    authorized: Path


@dataclass(frozen=True)
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def _secret_mode(path: Path) -> None:
    try:
        os.chmod(path, 0o600)
    except OSError as exc:  # e.g. a file system without modes: said, not fatal
        log.warning("could not restrict %s to mode 0600: %s", path, exc)


def create_keys(directory: str | os.PathLike[str], clients: list[str] | tuple[str, ...] = ("client",)
                ) -> dict[str, Path]:
    """Write the server key pair (kept if present) and one pair per client name (kept
    if present), and authorise each client. Returns name -> path of each file made or kept."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    (root / AUTHORIZED).mkdir(exist_ok=True)
    paths: dict[str, Path] = {}
    for name in (SERVER, *clients):
        if not name or "/" in name or name == AUTHORIZED or name.startswith("."):
            raise KeyFileError(f"key name {name!r} is not a plain file name; use letters, "
                               "digits, '-' and '_'")
        public, secret = root / f"{name}.key", root / f"{name}.key_secret"
        if not secret.exists():
            zmq.auth.create_certificates(root, name)
        _secret_mode(secret)
        paths[f"{name}.key"], paths[f"{name}.key_secret"] = public, secret
        if name != SERVER:
            dest = root / AUTHORIZED / f"{name}.key"
            shutil.copyfile(public, dest)
            paths[f"{AUTHORIZED}/{name}.key"] = dest
    return paths


def _load(path: Path, what: str, want_secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeyFileError(f"{what}: no key file at {path}; create keys with `evobus keys DIR`")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise KeyFileError(f"{what}: {path} is not a ZeroMQ certificate ({exc}); create keys "
                           "with `evobus keys DIR`") from None
    if want_secret and not secret:
        raise KeyFileError(f"{what}: {path} holds no secret key; pass the .key_secret file")
    return public, secret


def load_server_keys(directory: str | os.PathLike[str]) -> ServerKeys:
    """The broker's key pair and its directory of authorised client keys."""
    root = Path(directory)
    public, secret = _load(root / f"{SERVER}.key_secret", "the broker's secret key", True)
    authorized = root / AUTHORIZED
    if not authorized.is_dir() or not any(authorized.glob("*.key")):
        raise KeyFileError(f"{authorized} holds no client keys, so no worker could connect; "
                           "add some with `evobus keys DIR --client NAME`")
    return ServerKeys(public=public, secret=secret, authorized=authorized)


def load_client_keys(key_file: str | os.PathLike[str],
                     server_key_file: str | os.PathLike[str]) -> ClientKeys:
    """A worker's key pair (``--key``) and the broker's public key (``--server-key``)."""
    public, secret = _load(Path(key_file), "--key", True)
    server_public, _ = _load(Path(server_key_file), "--server-key", False)
    return ClientKeys(public=public, secret=secret, server_public=server_public)


def key_names(keys: ServerKeys) -> dict[str, str]:
    """The authorised client keys by their public key (z85, as the ZAP handler names a
    CURVE peer): public key -> the key's name (``laptop`` for ``laptop.key``)."""
    names = {}
    for path in sorted(keys.authorized.glob("*.key")):
        try:
            public, _ = zmq.auth.load_certificate(path)
        except (ValueError, OSError):  # not a certificate: the authenticator skips it too
            continue
        names[public.decode("ascii")] = path.stem
    return names


def start_authenticator(ctx: zmq.Context, keys: ServerKeys) -> ThreadAuthenticator:
    """Accept CURVE clients whose public key is in ``keys.authorized`` (and no one else)."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("bus.security.zap"))
    auth.start()
    # Keys are read now: a key added or deleted later counts from the next run.
    auth.configure_curve(domain=ZAP_DOMAIN.decode(), location=str(keys.authorized))
    return auth


def secure_server(sock: zmq.Socket, keys: ServerKeys) -> None:
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.server_public


#: Transports that stay on this machine: in-process and Unix-domain sockets.
_LOCAL_TRANSPORTS = ("inproc://", "ipc://")


def loopback_only(addr: str) -> bool:
    """Whether ``addr`` cannot reach another machine: ``inproc://``, ``ipc://``, or
    ``tcp://`` on a loopback host. Every other transport (udp, pgm, epgm, tipc, vmci,
    ws, ...) and every other tcp host may; the one rule binds and connects obey."""
    if addr.startswith(_LOCAL_TRANSPORTS):
        return True
    if not addr.startswith("tcp://"):
        return False
    host = addr[len("tcp://"):].rsplit(":", 1)[0]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        return True
    try:  # an IP address: loopback is 127.0.0.0/8 and ::1 (not "127.0.0.1.example.com")
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host or interface name, "*": not known to be loopback
        return False
