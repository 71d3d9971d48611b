"""The Kubernetes manifests users copy from docs/launchers.md: each parses with the `kubernetes` client's models
(no field misspelled or lost on the way), and on every pod `paratrain run` derives one job over all the pods
from the variables that the manifest, or Kubeflow's operator, sets. There is no cluster here: no pod starts."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import doc_block
from kubernetes.client import ApiClient

from paratrain.cli import main

INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def _plain(value: Any) -> Any:
    """Scalars as text: the models keep `nvidia.com/gpu: 4` as "4"."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return str(value)


def _parses_as(data: dict[str, Any], model: str) -> Any:
    """`data` read into the client's model and written back unchanged: an unknown or misspelled field would be
    dropped, a missing required one raises."""
    client = ApiClient()
    obj = client._ApiClient__deserialize(data, model)  # type: ignore[attr-defined]
    assert _plain(client.sanitize_for_serialization(obj)) == _plain(data), model
    return obj


def _pod_env(container: dict[str, Any], index: int) -> dict[str, str]:
    """The container's variables as the pod with completion index `index` sees them."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == INDEX, var
            env[var["name"]] = str(index)
    return env


def _derived(container: dict[str, Any], env: dict[str, str], monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The torchrun arguments `paratrain run --dry-run` prints in this container, with this environment."""
    command = container["command"]
    assert command[:2] == ["paratrain", "run"], command
    for name in [k for k in os.environ if k.startswith(("PET_", "SLURM_"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["run", "--dry-run", *command[2:]]) == 0
    printed = capsys.readouterr().out.splitlines()[-1].split()
    return printed[printed.index("torch.distributed.run") + 1 :]


def _one_job(pods: list[list[str]], nodes: int, endpoint: str) -> None:
    for rank, args in enumerate(pods):
        assert f"--nnodes={nodes}" in args and "--nproc-per-node=4" in args, args
        assert f"--rdzv-endpoint={endpoint}" in args, args
        assert f"--rdzv-conf=is_host={str(rank == 0).lower()},join_timeout=300" in args, args
        assert not any(a.startswith("--node-rank") for a in args), args


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_pytorchjob(in_tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    job = yaml.safe_load(doc_block("manifest: pytorchjob"))
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert list(replicas) == ["Master", "Worker"]
    pods = []
    for spec in replicas.values():  # the operator numbers the master 0, then the workers
        assert set(spec) == {"replicas", "restartPolicy", "template"}
        _parses_as(spec["template"], "V1PodTemplateSpec")
        container = spec["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"  # the name the operator looks for
        for _ in range(spec["replicas"]):
            operator = {"PET_NNODES": str(sum(r["replicas"] for r in replicas.values())),
                        "PET_NODE_RANK": str(len(pods)), "PET_MASTER_ADDR": f"{job['metadata']['name']}-master-0",
                        "PET_MASTER_PORT": "23456", "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"]}
            pods.append(_derived(container, operator, monkeypatch, capsys))
    _one_job(pods, 2, "train-master-0:23456")


def test_indexed_job(in_tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    service, job = yaml.safe_load_all(doc_block("manifest: job"))
    _parses_as(service, "V1Service")
    _parses_as(job, "V1Job")
    name, spec = job["metadata"]["name"], job["spec"]
    pod = spec["template"]["spec"]
    # pod i is named NAME-i; the headless Service it names as subdomain gives it NAME-i.SERVICE
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": name}
    assert pod["subdomain"] == service["metadata"]["name"] and spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    container = pod["containers"][0]
    pods = [_derived(container, _pod_env(container, i), monkeypatch, capsys) for i in range(spec["completions"])]
    _one_job(pods, spec["completions"], f"{name}-0.{pod['subdomain']}:29500")


def test_jobset(in_tmp: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    jobset = yaml.safe_load(doc_block("manifest: jobset"))
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert set(jobset["spec"]) == {"failurePolicy", "replicatedJobs"}
    (replicated,) = jobset["spec"]["replicatedJobs"]
    assert replicated["replicas"] == 1
    _parses_as(replicated["template"], "V1JobTemplateSpec")
    spec = replicated["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    container = spec["template"]["spec"]["containers"][0]
    pods = [_derived(container, _pod_env(container, i), monkeypatch, capsys) for i in range(spec["completions"])]
    # pod p of job j is JOBSET-REPLICATEDJOB-j-p, under the JobSet's name as subdomain
    first = f"{jobset['metadata']['name']}-{replicated['name']}-0-0.{jobset['metadata']['name']}"
    _one_job(pods, spec["completions"], f"{first}:29500")
