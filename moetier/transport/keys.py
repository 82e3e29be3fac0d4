"""Where a worker may listen and who may talk to it: endpoints, CurveZMQ keys, the ZAP gate, the loopback rule.

`check_endpoint` is the one parser of worker addresses (`moetier worker
--listen`, `moetier ping`, a layout's remote tiers, `WorkerClient`): tcp://HOST:PORT
with PORT in 1-65535 (0 or * too, to listen: any free port), ipc://PATH or
inproc://NAME; anything else is refused in one line before ZeroMQ sees it
(ZeroMQ itself takes port 99999 as 34463).

`generate(DIR)` writes a worker key pair and a client key pair as ZeroMQ
certificate files (secrets readable by the owner only) and lists the client's
public key in `DIR/authorized_clients/`. A worker started with `--keys DIR`
is a CURVE server whose ZAP authenticator admits only the public keys found
there: a plaintext client or one with an unlisted key never reaches the
worker's code. Invariant: `check_listen` refuses a bad endpoint, and an
address beyond loopback unless keys are given, before anything is bound.

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


class EndpointError(ValueError):
    """A worker address that is not tcp://HOST:PORT with PORT in range, ipc://PATH or inproc://NAME."""


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


def check_endpoint(endpoint: str, listen: bool = False, what: str = "worker address") -> str:
    """`endpoint` if it is one a worker can listen on (`listen`) or a client connect to, else EndpointError naming
    `what` (the flag or key it came from), the value and what was expected."""
    shown = _show(endpoint)
    scheme, separator, rest = endpoint.partition("://")
    if separator and scheme in ("ipc", "inproc") and rest:
        return endpoint
    host, colon, port = rest.rpartition(":")
    if not separator or scheme != "tcp" or not colon or not host.strip("[]"):
        raise EndpointError(f"{what} {shown} is not an endpoint (expected tcp://HOST:PORT, ipc://PATH or inproc://NAME)")
    if listen and port == "*":
        return endpoint
    lowest = 0 if listen else 1
    if not (port.isascii() and port.isdigit() and len(port) <= 5 and lowest <= int(port) <= 65535):
        free = "; 0 or * listens on any free port" if listen else ""
        raise EndpointError(f"{what} {shown}: port {_show(port)} is not an integer in {lowest}-65535 (expected tcp://HOST:PORT{free})")
    return endpoint


def _show(text: str) -> str:
    shown = repr(text)
    return shown if len(shown) <= 100 else shown[:97] + "..."


def check_listen(endpoint: str, keys: str | Path | None, what: str = "listen address") -> None:
    """Refuse a bad endpoint, and one beyond loopback without CurveZMQ keys (one clear line)."""
    check_endpoint(endpoint, listen=True, what=what)
    if keys is None and not is_loopback(endpoint):
        raise KeysError(f"refusing to listen on {endpoint} without --keys: a worker reachable beyond loopback must "
                        "authenticate its clients (make keys with `moetier keys gen DIR`, then pass --keys DIR)")
