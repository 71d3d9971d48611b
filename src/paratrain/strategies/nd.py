"""N-D strategies from the grammar: any `+`-joined set of ddp, fsdp, tp, cp, ep and pp on one DeviceMesh
(`parallel.dims`). The preset `ddp+pp` is one of them: replicas of a pipeline, the pipeline axis outermost.

The model is put in its final form by `parallel.parallelize`, one ordered list of `apply_*` steps gated by the
degrees (torchtitan's order); this file is what the layout does at each step of training: which micro-steps
synchronise, how a pipeline's step and loss are run, which combinations are refused.

    "fsdp+tp", world 4:    tp group {0, 1}  tp group {2, 3}      rows of the global batch
                           dp_shard group {0, 2}, {1, 3}          ranks 0, 1: first half; 2, 3: second half
    "tp+pp", world 4:      stage 0 on ranks {0, 1} (tp group), stage 1 on {2, 3};  pp groups {0, 2}, {1, 3}

Replicas of a pipeline ("dp_replicate") average their stages' gradients when a window ends
(`parallel.data_parallel.replicas`); with `fsdp` beside `pp` each stage is one FSDP2 unit over the ranks holding it
(`parallel.pipeline.sharded`), and torch's PipelineStage drives its gradient reduction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config import Config
from ..errors import ParatrainError
from ..parallel.context import own_tokens, share_of
from ..parallel.data_parallel import evaluate, forward_backward
from ..parallel.data_parallel.fsdp import set_fsdp_sync
from ..parallel.data_parallel.replicas import Replicas, Stages
from ..parallel.dims import ParallelDims, canonical, dims_for, parse
from ..parallel.microbatch import pipeline_bound
from ..parallel.options import check_pipeline
from ..parallel.parallelize import parallelize
from .base import Backward, Context, LossFn


class NDStrategy:
    needs_process_group = True
    sharded_state = True
    comm_hooks = False

    def __init__(self, name: str) -> None:
        self.name = canonical(name)
        self.axes = parse(name)
        self.microbatched = self.scheduled = "pp" in self.axes

    def degrees(self, config: Config, world: int) -> ParallelDims:
        return dims_for(self.name, world, tp_size=config.tp_size, pp_size=config.pp_size,
                        dp_replicate=config.dp_replicate, ep_size=config.ep_size, cp_size=config.cp_size)

    def check(self, ctx: Context) -> None:
        dims = ctx.dims
        if dims.ep > 1 and dims.cp > 1:
            raise ParatrainError(
                f"strategy {self.name!r}: expert parallelism beside context parallelism is not built (the experts "
                "would see each rank's share of the tokens); drop 'ep' or 'cp'")
        if dims.pp > 1:
            check_pipeline(ctx.config, dims.pp, f"strategy {self.name!r}")

    def bound(self, ctx: Context) -> float:
        dims = ctx.dims
        if dims.pp > 1:
            return dims.dp * dims.tp * pipeline_bound(dims.pp, ctx.config.microbatches)
        return float(ctx.placement.world_size)

    def devices(self, ctx: Context) -> list[torch.device]:
        return [ctx.device]

    def wrap(self, model: nn.Module, ctx: Context, example: Any) -> nn.Module:
        return parallelize(model, ctx.dims, ctx, example, self.name)

    def data_shard(self, ctx: Context) -> tuple[int, int]:
        return ctx.dims.data_shard(ctx.placement.rank)

    def set_gradient_sync(self, model: nn.Module, sync: bool) -> None:
        experts = _experts_of(model)
        if experts is not None:
            experts.sync = sync
        if isinstance(model, Stages):
            model.sync = model.pipe.sync = sync  # the pipeline sums tied gradients when the window ends
        elif isinstance(model, Replicas):
            model.sync = sync
        else:
            set_fsdp_sync(model, sync)

    def forward_backward(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn, backward: Backward,
                         ctx: Context) -> torch.Tensor:
        if "pp" not in self.axes:
            share = share_of(self.unwrap(model)) if ctx.config.loss == "token_mean" else None
            if share is None:
                return forward_backward(model, inputs, targets, loss_fn, backward)
            with own_tokens(share, loss_fn) as own_loss:  # each cp rank its own tokens' loss: no logits gathered
                return forward_backward(model, inputs, targets, own_loss, backward)
        from ..parallel.pipeline.pipelining import global_loss

        if not isinstance(model, Stages):
            raise ParatrainError(f"strategy {self.name!r}: pass the model returned by run.prepare to forward_backward")
        experts = _experts_of(model)
        sync = model.sync
        if experts is not None:  # reduced once per schedule, after its last micro-batch, not after each backward
            experts.sync = False
        local = model(inputs, targets, loss_fn, ctx.config.grad_accum)
        if sync:  # averaged first: the tied sums then write into the averaged buffers in place
            model.average()
            model.pipe.reduce_tied_gradients()
            if experts is not None:
                experts.reduce()
        dims = ctx.dims
        return global_loss(local, dims.dp * dims.tp * dims.cp, ctx.device)  # every tp and cp rank of a last stage

    def evaluate(self, model: nn.Module, inputs: Any, targets: Any, loss_fn: LossFn | None, ctx: Context) -> Any:
        if "pp" in self.axes:
            from ..parallel.pipeline import pipelining

            return pipelining.evaluate(model, inputs, targets, loss_fn, ctx.device)
        return evaluate(model, inputs, targets, loss_fn, ctx.device)

    def pipeline_ranks(self, ctx: Context) -> int:
        return ctx.dims.pp

    def unwrap(self, model: nn.Module) -> nn.Module:
        if isinstance(model, Stages):
            return model.pipe.holds()
        return model.module if isinstance(model, Replicas) else model


def _experts_of(model: nn.Module) -> Any:
    """The expert gradients' reducer of a prepared model (`parallel.expert.apply.ExpertGrads`), or None."""
    if isinstance(model, Stages):
        return model.pipe.experts
    inner = model.module if isinstance(model, Replicas) else model
    return inner.__dict__.get("_paratrain_experts")
