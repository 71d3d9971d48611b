"""The torchft lighthouse: the one small server replica groups ask, each step, which groups are alive.

torchft's lighthouse is a Rust server inside its native extension. It is loaded here without the rest of
torchft (whose package imports torch, seconds of CPU), so `paratrain run --replica-groups` starts it in a few
milliseconds in its own process, and `paratrain lighthouse` serves it alone for a cluster. It holds no training
state: losing it stops new quorums (steps), never the groups' weights.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ..errors import ParatrainError

INSTALL = "pip install 'paratrain[ft]'"

HEARTBEAT_TIMEOUT_S = 1.5
"""A group silent this long is left out of the next quorum: the survivors' wait after a group dies, most of what
losing a group costs them (benchmarks/goodput.py). Each group's manager beats every 0.1 s from a native thread that
the GIL does not hold up, so 15 beats missed in a row mean a dead process; a live group left out by mistake (a
machine stalled that long) rejoins at the next step by recovering, as a restarted one does."""

JOIN_TIMEOUT_S = 10.0
"""How long a quorum waits for a group that is alive but not yet asking (a group still starting)."""


def require_torchft(what: str) -> None:
    """Refuse `what` where torchft cannot be imported, naming the install (checked without importing torch)."""
    if importlib.util.find_spec("torchft") is None:
        raise ParatrainError(f"{what} needs torchft, which is not installed in this environment; {INSTALL}")


def _native() -> ModuleType:
    """torchft's native extension alone: the lighthouse server without torch."""
    require_torchft("the replica-group lighthouse")
    spec = importlib.util.find_spec("torchft")
    assert spec is not None and spec.submodule_search_locations
    folder = next(iter(spec.submodule_search_locations))
    library = next((f for f in os.listdir(folder) if f.startswith("_torchft.") and f.endswith((".so", ".pyd"))), None)
    if library is None:
        raise ParatrainError(f"torchft in {folder} has no native extension (_torchft); reinstall it: {INSTALL}")
    native = importlib.util.spec_from_file_location("torchft._torchft", os.path.join(folder, library))
    assert native is not None and native.loader is not None
    module = importlib.util.module_from_spec(native)
    native.loader.exec_module(module)
    return module


@dataclass
class Lighthouse:
    """A running lighthouse; `address` is what workers are given (http://HOST:PORT)."""

    server: Any
    address: str

    def shutdown(self) -> None:
        self.server.shutdown()


def start(host: str = "127.0.0.1", port: int = 0, *, min_groups: int = 1,
          heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, join_timeout_s: float = JOIN_TIMEOUT_S) -> Lighthouse:
    """Serve a lighthouse on host:port (port 0: a free one, read back, so no other program can take it first)."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs every quorum at INFO; RUST_LOG=info shows them
    try:
        server = _native().LighthouseServer(
            bind=f"{host}:{port}", min_replicas=min_groups, join_timeout_ms=int(join_timeout_s * 1000),
            quorum_tick_ms=50, heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))
    except Exception as exc:  # noqa: BLE001 - the native server raises a plain RuntimeError with the OS's reason
        raise ParatrainError(f"cannot start the lighthouse on {host}:{port} ({exc}); choose another --port") from None
    bound = int(str(server.address()).rsplit(":", 1)[1])
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "[::]") else host
    return Lighthouse(server, f"http://{shown}:{bound}")


def normalize(address: str) -> str:
    """HOST:PORT (what users type) or http://HOST:PORT, as torchft wants it."""
    bare = address.removeprefix("http://").rstrip("/")
    host, _, port = bare.rpartition(":")
    if not host or not port.isdigit():
        raise ParatrainError(f"--lighthouse {address!r}: use HOST:PORT (the address `paratrain lighthouse` printed)")
    return f"http://{bare}"


def wait_until_reachable(address: str, timeout_s: float) -> None:
    """Return once the lighthouse accepts connections, or fail within `timeout_s` naming the fix (not a hang)."""
    host, _, port = normalize(address).removeprefix("http://").rpartition(":")
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(2.0, max(timeout_s, 0.1))):
                return
        except OSError as exc:
            last = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    raise ParatrainError(
        f"cannot reach the replica-group lighthouse at {host}:{port} within {timeout_s:.0f} s ({last}); start it "
        "first (`paratrain lighthouse --port PORT`) and pass that HOST:PORT to --lighthouse, or check firewalls "
        "(or raise --connect-timeout)"
    )


def serve(host: str, port: int, *, min_groups: int, heartbeat_timeout_s: float, join_timeout_s: float) -> int:
    """`paratrain lighthouse`: serve in the foreground until SIGINT or SIGTERM."""
    lighthouse = start(host, port, min_groups=min_groups, heartbeat_timeout_s=heartbeat_timeout_s,
                       join_timeout_s=join_timeout_s)
    print(f"paratrain lighthouse: serving at {lighthouse.address} (min groups {min_groups}, a group silent "
          f"{heartbeat_timeout_s:g} s is dropped); groups: paratrain run --replica-group I --replica-groups R "
          f"--lighthouse {lighthouse.address.removeprefix('http://')} ...", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    lighthouse.shutdown()
    return 0
