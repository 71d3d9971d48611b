"""`setup(compile=...)`: what it refuses, and inductor's generated code against the plain eager loop.

The layouts are checked in the correctness matrix (compile cells, tests/test_matrix.py, with the aot_eager
backend, whose results equal eager ones exactly); here inductor itself runs once, on the CPU, where it builds
C++ kernels: a machine without a C++ compiler skips that test and says why.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import zoo
from torch._dynamo.utils import counters
from zoo.compare import mismatches
from zoo.dropout_rule import layout_rule
from zoo.reference import Optim, global_batches, run_reference

import paratrain
from paratrain.parallel import activation_checkpoint
from paratrain.parallel import compile as compile_blocks
from paratrain.parallel.pipeline import schedules


def test_compile_options_are_refused_with_their_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(paratrain.ParatrainError, match="not a torch.compile backend here.*aot_eager"):
        paratrain.setup(strategy="single", compile="inductr")
    with pytest.raises(paratrain.ParatrainError, match="True, False or a torch.compile backend name"):
        paratrain.setup(strategy="single", compile=3)
    # a named zero-bubble schedule runs the backward in two passes; "auto" leaves it out under compile
    with pytest.raises(paratrain.ParatrainError, match="allows one backward.*compile=False"):
        schedules.check("zero-bubble", 2, 2, 4, compiling=True)
    assert "zero-bubble" in schedules.auto_names(1) and "zero-bubble" not in schedules.auto_names(1, compiling=True)

    # no C++ compiler: refused at prepare, before anything is compiled, naming the install and aot_eager
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    run = paratrain.setup(strategy="single", compile=True, accelerator="cpu")
    try:
        model = zoo.MODELS["gpt"].build(0)
        with pytest.raises(paratrain.ParatrainError, match="C\\+\\+ compiler.*g\\+\\+.*aot_eager"):
            run.prepare(model)
        assert compile_blocks.compiled(model) == 0
    finally:
        run.close()


def test_a_model_compiled_before_prepare_is_refused_by_pipelines() -> None:
    """A pipeline cuts the model itself: an OptimizedModule is refused with the option that compiles stages."""
    case = zoo.MODELS["gpt"]
    run = paratrain.setup(strategy="mp", devices=["cpu", "cpu"], balance="equal", microbatches=2, accelerator="cpu")
    try:
        model = torch.compile(case.build(0), backend="eager")
        with pytest.raises(paratrain.ParatrainError, match="torch.compile'd before run.prepare.*compile=True"):
            run.prepare(model, example=global_batches(case, 0, (4,))[0][0])
    finally:
        run.close()


def _train_compiled(model: str, sizes: tuple[int, ...], option: bool | str) -> dict[str, Any]:
    """The plain loop through setup(strategy="single", compile=option), dynamo's counts from a clean start:
    losses, weights and dynamo's graph count after every step, and how many blocks there are and run compiled."""
    counters.clear()  # dynamo's process-wide counts: only this run's compiles
    case = zoo.MODELS[model]
    run = paratrain.setup(strategy="single", seed=0, compile=option, accelerator="cpu")
    try:
        net = case.build(0)
        prepared, optimizer = run.prepare(net, Optim().make(net.parameters(), case))
        out: dict[str, Any] = {"losses": [], "weights": [], "graphs": [], "compiled": compile_blocks.compiled(prepared),
                               "blocks": len(activation_checkpoint.blocks(run.unwrap(prepared)))}
        for inputs, targets in global_batches(case, 0, sizes):
            out["losses"].append(float(run.forward_backward(prepared, inputs, targets, case.loss_fn)))
            optimizer.step()
            optimizer.zero_grad()
            out["weights"].append({k: v.detach().clone() for k, v in run.unwrap(prepared).state_dict().items()})
            out["graphs"].append(counters["stats"]["unique_graphs"])
    finally:
        run.close()
    out["frames"] = dict(counters["frames"])  # a frame past the recompile limit counts in total, not in ok
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_inductor_trains_like_the_eager_loop() -> None:
    """compile=True (inductor, C++ kernels on the CPU): every block compiled, losses and weights at every step
    like the plain eager loop within the fp32 tolerance, no new graph after the first steps and no frame given
    up. The zoo's MLP: inductor's first compile costs 25 s here even for it, 45 s for the GPT; the transformer
    blocks and dropout between compiled pieces are the matrix's compile cells' (aot_eager)."""
    why = compile_blocks.missing_toolchain("inductor", torch.device("cpu"))
    if why:
        pytest.skip(why)
    case, sizes = zoo.MODELS["mlp"], (8, 8, 8, 8)
    want = run_reference(case, global_batches(case, 0, sizes))
    got = _train_compiled("mlp", sizes, True)
    assert got["compiled"] == got["blocks"] >= 1
    problems = mismatches(got["losses"], got["weights"], want, case.tolerances["fp32"])
    assert not problems, problems
    graphs, frames = got["graphs"], got["frames"]
    assert graphs[1] == graphs[-1], f"dynamo compiled new graphs after the first steps: {graphs}"
    assert frames["total"] == frames["ok"], f"dynamo gave up on {frames['total'] - frames['ok']} frame(s)"


@pytest.mark.timeout(120)
def test_dropout_modules_between_compiled_blocks_draw_the_plain_loops_masks() -> None:
    """compile="aot_eager" (exact) on the GPT with nn.Dropout modules inside its blocks: results equal to the plain
    loop with paratrain's mask rule at every step, and dynamo gives up on no frame (inside a compiled block the
    masks' position would recompile at every call, past torch's limit)."""
    case, sizes = zoo.MODELS["gpt_dropout"], (8, 8, 4)
    want = run_reference(case, global_batches(case, 0, sizes), dropout=layout_rule)
    got = _train_compiled("gpt_dropout", sizes, "aot_eager")
    assert got["compiled"] == got["blocks"] > 1
    assert not mismatches(got["losses"], got["weights"], want, case.tolerances["fp32"])
    assert max(abs(a - b) for a, b in zip(got["losses"], want.losses)) == 0.0
    frames = got["frames"]
    assert frames["total"] == frames["ok"] > 0, frames
