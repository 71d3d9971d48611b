"""`paratrain.launch` from a real Jupyter notebook, executed by a kernel running this venv's python: functions
defined in cells reach the workers (where `mp.spawn` fails with "Can't get attribute ... on <module
'__main__'>"), worker output appears in the cell, results come back, and a failing rank surfaces with its
traceback while its blocked peer is ended."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import nbclient
import nbformat
import pytest
from helpers import alive

CELLS = [
    """
    import json, os, threading
    import torch
    import paratrain
    from paratrain.launcher.spawn import WorkerFailed
    """,
    """
    def demo_basic(scale):
        run = paratrain.setup(strategy="ddp")
        print(f"hello from rank {run.rank} pid {os.getpid()}")
        total = run.all_reduce(torch.tensor((run.rank + 1) * scale), op="sum")
        out = {"rank": run.rank, "world": run.world_size, "threads": torch.get_num_threads(),
               "total": float(total), "pid": os.getpid()}
        run.close()
        return out
    """,
    """
    results = paratrain.launch(demo_basic, 10.0, nproc=2, all_ranks=True, timeout=120)
    """,
    """
    def fails_on_rank_1():
        run = paratrain.setup(strategy="ddp")
        print(f"worker pid {os.getpid()}", flush=True)
        if run.rank == 1:
            raise ValueError("rank 1 gives up in a notebook cell")
        threading.Event().wait()  # rank 0 would wait forever: only the launcher can end it

    try:
        paratrain.launch(fails_on_rank_1, nproc=2, timeout=120)
        failure = None
    except WorkerFailed as err:
        failure = {"rank": err.rank, "detail": err.detail, "error": repr(err.error)}
    """,
    """
    print("REPORT " + json.dumps({"results": results, "failure": failure}))
    """,
]


def _kernel_manager(tmp: Path):  # type: ignore[no-untyped-def]
    """A kernel running exactly this interpreter (which has paratrain), whatever kernels are installed."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    spec = tmp / "kernels" / "paratrain-venv"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "paratrain venv", "language": "python"}))
    specs = KernelSpecManager(kernel_dirs=[str(tmp / "kernels")])
    return KernelManager(kernel_name="paratrain-venv", kernel_spec_manager=specs)


def _stream_text(cell, name: str = "stdout") -> str:  # type: ignore[no-untyped-def]
    return "".join(o["text"] for o in cell.outputs if o.get("output_type") == "stream" and o["name"] == name)


def test_launch_from_a_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the launcher, not the kernel's environment, decides threads
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(textwrap.dedent(src).strip()) for src in CELLS]
    km = _kernel_manager(tmp_path)
    client = nbclient.NotebookClient(nb, km=km, timeout=180, resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    finally:
        if km.has_kernel:
            km.shutdown_kernel()  # a kernel manager handed to nbclient stays ours to stop

    launch_out = _stream_text(nb.cells[2])
    report = json.loads(_stream_text(nb.cells[4]).split("REPORT ", 1)[1])

    # Results of every rank came back; setup() found world size 2 and each worker has one thread.
    results = report["results"]
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["threads"] == 1 and r["total"] == 30.0 for r in results)
    # Worker prints were forwarded into the cell that called launch, labelled by rank.
    for r in results:
        assert f"[rank{r['rank']}] hello from rank {r['rank']} pid {r['pid']}" in launch_out

    # The failing rank is named, with its traceback pointing into the cell's function.
    failure = report["failure"]
    assert failure is not None and failure["rank"] == 1
    assert "fails_on_rank_1" in failure["detail"]
    assert "ValueError: rank 1 gives up in a notebook cell" in failure["detail"]
    assert failure["error"].startswith("ValueError(")

    # No worker outlived its launch (the kernel itself is gone too: the conftest guard checks children).
    failing_out = _stream_text(nb.cells[3])
    pids = [int(line.rsplit(" ", 1)[1]) for line in failing_out.splitlines() if "worker pid" in line]
    pids += [r["pid"] for r in results]
    assert len(pids) == 4
    assert not [pid for pid in pids if alive(pid)]
    assert os.getpid() not in pids
