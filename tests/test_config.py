"""The typed configuration: every option documented, every value checked once with the fix named."""

from __future__ import annotations

import ast
import inspect

import pytest

from paratrain import ParatrainError
from paratrain.config import Config, make_config


def _error(**options: object) -> str:
    with pytest.raises(ParatrainError) as err:
        make_config(options)
    return str(err.value)


def test_every_field_has_a_docstring() -> None:
    tree = ast.parse(inspect.getsource(Config))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            following = body[i + 1] if i + 1 < len(body) else None
            assert isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant), \
                f"Config.{node.target.id} has no docstring"  # type: ignore[attr-defined]


def test_choices_are_checked_with_a_close_match() -> None:
    assert "Did you mean 'ddp'" in _error(strategy="ddq")
    assert "Did you mean '1f1b'" in _error(schedule="1fb1")
    assert "precision" in _error(precision="8")
    assert "Did you mean 'time'" in _error(balance="tme")
    assert "comm_hook" in _error(comm_hook="int8")
    assert "accelerator" in _error(accelerator="tpu")


def test_numbers_and_combinations() -> None:
    assert "grad_accum must be >= 1" in _error(grad_accum=0)
    assert "microbatches must be a positive int or 'auto'" in _error(microbatches="some")
    assert "timeout_s must be positive" in _error(timeout_s=0)
    assert "one layer per stage" in _error(balance=[2, 0])
    assert "stages_per_worker=1" in _error(schedule="1f1b", stages_per_worker=2)
    assert "contradict" in _error(static_graph=True, find_unused_parameters=True)
    assert "unknown setup option(s) ['bucket_mb']" in _error(bucket_mb=1)


def test_precision_may_be_a_number() -> None:
    assert make_config({"precision": 16}).precision == "16"
    assert make_config({}).strategy == "auto"


def test_pipelines_refuse_a_torch_they_are_not_proven_on() -> None:
    from paratrain.parallel.options import check_torch_for_pipelining

    check_torch_for_pipelining("strategy 'pp'")  # the torch this suite runs
    for proven in ("2.13.0+cpu", "2.14.0a0+git1234", "2.14.1", "3.0.0"):
        check_torch_for_pipelining("strategy 'pp'", proven)
    with pytest.raises(ParatrainError, match=r"torch 2\.11\.0\+cu130.*pip install 'torch>=2\.13'.*strategy 'mp'"):
        check_torch_for_pipelining("strategy 'ddp+pp'", "2.11.0+cu130")
    with pytest.raises(ParatrainError, match="torch 2.12.1"):
        check_torch_for_pipelining("strategy 'pp'", "2.12.1")
