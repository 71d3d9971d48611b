"""Mixtures of experts under expert parallelism and data parallelism, against plain PyTorch (docs/parallelism.md,
"Expert parallelism").

Each layout's run (tests/moe_worker.py) trains a user MoE decoder (router Linear, top-2 softmax, a ModuleList of
experts), Hugging Face Mixtral and Qwen2-MoE from tiny configs, the two with a load-balancing loss (the user's
through `paratrain.global_rows`, Mixtral's own `output_router_logits`) and with the gradient clipped by the whole
model's norm (`run.clip_grad_norm_`, the experts spread over the ranks) for three SGD steps (AdamW for
`user-adamw`): losses and exported weights equal to one process's (1e-5), each rank holding its share of the
experts. A listed block's rows travel once per forward (tests/test_moe_grouped_calls.py counts the exchanges).
Refusals run in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import moe_cases as cases
import pytest
import torch
from helpers import cli_env, paratrain

from paratrain.errors import ParatrainError
from paratrain.parallel import step_state
from paratrain.parallel.dims import dims_for
from paratrain.parallel.expert import router_stats
from paratrain.parallel.expert.apply import Groups, apply_ep

RUNS = (("ep", 2, ("user", "user-grouped", "mixtral", "qwen2_moe", "user-aux-global", "mixtral-aux", "user-clip",
                 "user-adamw"), 2),
        ("fsdp+ep", 4, ("user", "mixtral", "mixtral-aux", "user-adamw"), 4),
        ("fsdp+ep:2", 4, ("user-aux-global", "qwen2_moe", "user-clip", "mixtral-clip"), 2),
        ("ddp", 2, ("user-aux-global", "mixtral-aux"), 1),
        ("fsdp+tp+ep", 4, ("mixtral", "qwen2_moe", "mixtral-aux", "mixtral-clip", "user"), 2),
        ("ep+pp", 4, ("mixtral", "qwen2_moe", "user-seq", "mixtral-meta"), 2),
        ("fsdp+ep+pp", 4, ("mixtral", "qwen2_moe", "user-seq"), 2),
        ("tp+ep+pp", 8, ("mixtral", "qwen2_moe", "user-seq"), 2))
"""(layout[:ep_size], world, models, ranks of one expert group: each holds EXPERTS / that many experts). Under
`fsdp+tp+ep` the attention is split over the tensor ranks and the experts over the expert ranks (the library's
plan without its expert entries; the user decoder's found by structure); the two ranks of a tensor group hold the same
experts. `user-seq` is the user decoder as an nn.Sequential of its blocks, whose children are the pipeline's stages;
`-meta` a model built on the meta device, each rank materialising its stage's layers and, of those, its experts."""
CHECKPOINTED = {"fsdp+ep:2": "selective", "fsdp+tp+ep": "full"}
"""Runs with activation checkpointing, applied after the expert step (`parallel.parallelize`): the recomputation
dispatches the tokens again; under "selective" Hugging Face's default cache is off in training forwards."""


@pytest.fixture(scope="module")
def plain() -> dict[str, tuple[dict[str, torch.Tensor], list[float]]]:
    with step_state.using(step_state.StepState()):  # one process, outside any run an earlier test left active
        return {name: cases.plain(name) for name in {n for _, _, names, _ in RUNS for n in names}}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "world", "names", "group"), RUNS, ids=[r[0] for r in RUNS])
def test_moe_layouts_match_plain_pytorch(layout: str, world: int, names: tuple[str, ...], group: int,
                                         plain: dict, tmp_path: Path) -> None:
    import meta_cases

    res = paratrain("run", "--nproc", str(world), "tests/moe_worker.py", layout, str(tmp_path), *names, timeout=240,
                    env=cli_env(MOE_CHECKPOINTING=CHECKPOINTED.get(layout, "none")))
    assert res.returncode == 0, res.stdout[-4000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    held = [json.loads((tmp_path / f"held-{rank}.json").read_text()) for rank in range(world)]
    for name in names:
        ref, ref_losses = plain[name]
        assert losses[name] == pytest.approx(ref_losses, abs=1e-5), f"{name} under {layout}"
        got = meta_cases.read_export(str(tmp_path / name))
        assert set(got) == set(ref), f"{name}: exported {sorted(set(got) ^ set(ref))[:5]} differ from the state dict"
        worst = max((float((got[k] - ref[k]).abs().max()), k) for k in ref)
        assert worst[0] < 1e-5, f"{name} under {layout}: weights differ from the plain loop's: {worst}"
        pp = dims_for(layout.partition(":")[0], world).pp
        paths = {p for h in held for p in h[name]} - {"tokens", "tensor"}
        assert all(len(set(h[name]) - {"tokens", "tensor"}) == len(paths) // pp for h in held)  # a stage's layers
        assert all((h[name]["tensor"][0] > 0) == ("tp" in layout.split("+")) for h in held), (name, held)
        for path in paths:
            shares = [h[name][path] for h in held if path in h[name]]
            assert len(shares) == world // pp, f"{name} {path}: held by {len(shares)} ranks"
            assert all(len(s) == cases.EXPERTS // group for s in shares), f"{name} {path}: {shares}"
            distinct = {tuple(s) for s in shares}  # one expert group's shares, repeated by replicas and tensor ranks
            assert len(distinct) == group and sorted(e for s in distinct for e in s) == list(range(cases.EXPERTS))


def test_an_auxiliary_loss_over_one_ranks_tokens_is_refused_by_name() -> None:
    model = cases.build("user-aux")
    router_stats.install(model)
    x, y = cases.data()
    with step_state.using(step_state.StepState(rows=router_stats.Rows(0, 2, 1))):
        with pytest.raises(ParatrainError, match=r"blocks\.\d\.moe \(MoE\).*self\.aux.*global_rows"):
            cases.loss_fn(model(x[:4]), y[:4]).backward()  # refused once the term reaches the loss (test_moe_aux.py)
    with step_state.using(step_state.StepState()):
        model(x[:4])  # one process, outside a run: the tokens it sees are the batch


def test_global_rows_is_refused_where_a_forward_sees_a_micro_batch() -> None:
    model = cases.build("user-aux-global")
    x, _ = cases.data()
    with step_state.using(step_state.StepState(rows=router_stats.Rows(0, 1, 2))):
        with pytest.raises(ParatrainError, match="grad_accum=1"):
            model(x[:4])


def test_expert_parallel_refuses_what_it_cannot_split() -> None:
    groups = Groups(mesh=None, rank=0, size=3, replicas=None, replica_count=1, data_parallel=3)
    with pytest.raises(ParatrainError, match="4 experts, which 3 expert-parallel ranks cannot share"):
        apply_ep(cases.build("user"), groups)
    dense = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    with pytest.raises(ParatrainError, match="no mixture-of-experts layer.*drop 'ep'"):
        apply_ep(dense, groups)


def test_expert_parallelism_with_a_context_axis_is_refused_by_name_and_with_a_pipeline_built() -> None:
    from paratrain.config import make_config
    from paratrain.runtime import Placement
    from paratrain.strategies import Context, get

    def check(name: str, world: int) -> None:
        ctx = Context(config=make_config({"strategy": name}), device=torch.device("cpu"),
                      placement=Placement(world_size=world, local_world_size=world))
        get(name).check(ctx)  # the degrees from the name and the world (Context.dims)

    check("ddp+ep+pp", 4)  # experts inside pipeline stages (test_moe_layouts_match_plain_pytorch[ep+pp])
    with pytest.raises(ParatrainError, match="expert parallelism beside context parallelism is not built"):
        check("ddp+ep+cp", 8)


def test_expert_degrees_are_checked_with_their_arithmetic() -> None:

    assert dims_for("ep", 2).ep == 2 and dims_for("ep", 2).dp_replicate == 2
    assert (dims_for("fsdp+ep", 4, ep_size=2).ep, dims_for("fsdp+ep", 4).ep) == (2, 4)
    with pytest.raises(ParatrainError, match="ep 3 must be at least 2 and divide the 4 ranks of dp_shard"):
        dims_for("fsdp+ep", 4, ep_size=3)
    with pytest.raises(ParatrainError, match="has no ep axis but ep_size=2"):
        dims_for("fsdp", 2, ep_size=2)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "saved", "resumed"), [("user", ("fsdp+ep", 4), ("ep", 2)),
                                                        ("mixtral", ("ep", 2), ("ddp", 2)),
                                                        ("mixtral", ("ep+pp", 4), ("fsdp+ep", 4))],
                         ids=["user-fsdp+ep-to-ep", "mixtral-ep-to-ddp", "mixtral-ep+pp-to-fsdp+ep"])
def test_a_checkpoint_resumes_with_the_experts_laid_out_anew(name: str, saved: tuple[str, int],
                                                             resumed: tuple[str, int], tmp_path: Path) -> None:
    import meta_cases

    first = paratrain("run", "--nproc", str(saved[1]), "tests/moe_worker.py", saved[0], str(tmp_path / "a"), name,
                      timeout=240, env=cli_env(MOE_SAVE=str(tmp_path / "ck")))
    assert first.returncode == 0, first.stdout[-4000:]
    step = next((tmp_path / "ck").glob("step-*"))
    rest = paratrain("run", "--nproc", str(resumed[1]), "tests/moe_worker.py", resumed[0], str(tmp_path / "b"), name,
                     timeout=240, env=cli_env(MOE_RESUME=str(step)))
    assert rest.returncode == 0, rest.stdout[-4000:]
    with step_state.using(step_state.StepState()):
        ref, ref_losses = cases.plain(name)
    assert json.loads((tmp_path / "b" / "losses.json").read_text())[name] == pytest.approx(ref_losses[1:], abs=1e-5)
    got = meta_cases.read_export(str(tmp_path / "b" / name))
    worst = max((float((got[k] - ref[k]).abs().max()), k) for k in ref)
    assert worst[0] < 1e-5, f"{name} saved under {saved}, resumed under {resumed}: {worst}"
