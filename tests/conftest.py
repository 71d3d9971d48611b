"""Test tiers share these guards: the environment is restored, process groups are destroyed, and a test
that leaves a child process behind fails."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The suite tests CPU workers (each a "device"), identically on a machine with GPUs: they are hidden
# before torch looks for them, except for the GPU tests (`make test-gpu`: PARATRAIN_TEST_GPU=1, -m gpu).
if not os.environ.get("PARATRAIN_TEST_GPU"):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))


def _children() -> set[int]:
    """PIDs of live (non-zombie) descendants of this process."""
    me = os.getpid()
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {me}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


@pytest.fixture(autouse=True)
def _guard():
    env = dict(os.environ)
    before = _children()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    leaked = _children() - before
    if leaked:
        import signal
        import time

        time.sleep(1.0)
        leaked = _children() - before
        for pid in leaked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leaked:
            pytest.fail(f"test left processes behind: {sorted(leaked)}")
