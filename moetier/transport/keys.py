"""CurveZMQ keys, the ZAP gate, and the rule that keeps a keyless worker on loopback.

`generate(DIR)` writes a worker key pair and a client key pair as ZeroMQ
certificate files (secrets readable by the owner only) and lists the client's
public key in `DIR/authorized_clients/`. A worker started with `--keys DIR`
is a CURVE server whose ZAP authenticator admits only the public keys found
there: a plaintext client or one with an unlisted key never reaches the
worker's code. Invariant: `check_listen` refuses an address beyond loopback
unless keys are given, before anything is bound.

    DIR/worker.key, DIR/worker.key_secret      the worker's pair (copy worker.key to clients)
    DIR/client.key, DIR/client.key_secret      a client's pair (copy client.key_secret to it)
    DIR/authorized_clients/client.key          public keys the worker admits
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

WORKER = "worker"
AUTHORIZED = "authorized_clients"


class KeysError(ValueError):
    """Missing or unreadable key files, or a listen address that needs keys."""


def generate(folder: str | Path, client: str = "client") -> dict[str, Path]:
    """Create DIR with a worker pair (kept if present) and the client pair `client`, admitted by the worker."""
    folder = Path(folder)
    if not client.isidentifier():
        raise KeysError(f"client name {client!r} is not a plain name (expected letters, digits, underscores)")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / AUTHORIZED).mkdir(exist_ok=True)
    if not (folder / f"{WORKER}.key_secret").exists():
        zmq.auth.create_certificates(folder, WORKER)
    if (folder / f"{client}.key_secret").exists():
        raise KeysError(f"{folder / (client + '.key_secret')} exists (expected a new client name; pass another --client)")
    public, _ = zmq.auth.create_certificates(folder, client)
    for secret in folder.glob("*.key_secret"):
        os.chmod(secret, 0o600)
    admitted = folder / AUTHORIZED / f"{client}.key"
    admitted.write_bytes(Path(public).read_bytes())
    return {"worker_secret": folder / f"{WORKER}.key_secret", "worker_public": folder / f"{WORKER}.key",
            "client_secret": folder / f"{client}.key_secret", "authorized": admitted}


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise KeysError(f"{path}: key file not found (make keys with `moetier keys gen {path.parent}`)")
    try:
        public, private = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as err:
        raise KeysError(f"{path}: not a ZeroMQ certificate ({err})") from None
    if secret and private is None:
        raise KeysError(f"{path}: has no secret key (expected a .key_secret file)")
    if secret and path.stat().st_mode & 0o077:  # as ssh does with private keys
        raise KeysError(f"{path}: the secret key is readable by other users (run `chmod 600 {path}`)")
    return public, private


def worker_keys(folder: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) of the worker."""
    public, secret = _load(Path(folder) / f"{WORKER}.key_secret", secret=True)
    return public, secret  # type: ignore[return-value]


def client_keys(folder: str | Path, client: str = "client") -> tuple[bytes, bytes, bytes]:
    """(client public, client secret, worker public) for a client."""
    folder = Path(folder)
    public, secret = _load(folder / f"{client}.key_secret", secret=True)
    server, _ = _load(folder / f"{WORKER}.key", secret=False)
    return public, secret, server  # type: ignore[return-value]


def make_server(socket: zmq.Socket, folder: str | Path) -> None:
    public, secret = worker_keys(folder)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True


def make_client(socket: zmq.Socket, folder: str | Path, client: str = "client") -> None:
    public, secret, server = client_keys(folder, client)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = server


def start_authenticator(context: zmq.Context, folder: str | Path) -> ThreadAuthenticator:
    """A ZAP handler thread admitting only the public keys in DIR/authorized_clients (call before bind)."""
    authorized = Path(folder) / AUTHORIZED
    if not authorized.is_dir() or not any(authorized.glob("*.key")):
        raise KeysError(f"{authorized}: no client public keys (expected *.key files; `moetier keys gen` writes one)")
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized))
    return auth


def is_loopback(endpoint: str) -> bool:
    """True for tcp:// on 127.0.0.0/8, ::1 or localhost, and for ipc:// and inproc:// (never leave the host)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", an interface name, a host name: may reach the network
        return False


def check_listen(endpoint: str, keys: str | Path | None) -> None:
    """Refuse to listen beyond loopback without CurveZMQ keys (one clear line)."""
    if keys is None and not is_loopback(endpoint):
        raise KeysError(f"refusing to listen on {endpoint} without --keys: a worker reachable beyond loopback must "
                        "authenticate its clients (make keys with `moetier keys gen DIR`, then pass --keys DIR)")
