"""The ways tensor parallelism shards a layer, by name, and the torch `ParallelStyle` each name stands for.

A plan maps module (or, for Hugging Face expert weights, parameter) names to these styles:

| style | layer | what each tensor rank holds and computes |
| --- | --- | --- |
| `colwise` | Linear, Conv1D, Embedding | 1/tp of the output features; the output stays split |
| `rowwise` | Linear, Conv1D, Embedding | 1/tp of the input features (an Embedding: of the vocabulary); outputs summed |
| `colwise_gather_output` | Linear | `colwise`, the output gathered whole again |
| `rowwise_split_input` | Linear | `rowwise` fed the whole input, split on entry |
| `packed_colwise` | Linear, Conv1D | a fused weight of P equal parts (q/k/v, gate/up): 1/tp of each part |
| `experts` | a module of 3-D expert weights | 1/tp of every expert's hidden features; outputs summed |
| `partial_grad` | any | the whole layer, its gradients summed over the ranks (a q/k norm over the local heads) |
| `replicate` | any | the whole layer (Hugging Face's `sequence_parallel`, `local_*` and `replicate` map here) |

Linear and Embedding layers in the first four styles are torch's own `ColwiseParallel` / `RowwiseParallel` on
DTensor. The rest (Hugging Face's GPT-2 `Conv1D`, which stores its weight transposed; fused weights, whose rank
piece is a strided slice DTensor writes as `_StridedShard`; expert weights, which a module indexes per expert)
keep their parameters as DTensors too, so checkpoints, FSDP and the optimizer see the whole tensors, but run their
forward on the local pieces, with the collectives of Megatron's f and g operators around it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ... import _forwards
from ...errors import ParatrainError

STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "packed_colwise", "experts",
          "partial_grad", "replicate")

HF_STYLES = {
    "colwise": "colwise", "rowwise": "rowwise", "colwise_rep": "colwise_gather_output",
    "colwise_gather_output": "colwise_gather_output", "rowwise_rep": "rowwise_split_input",
    "rowwise_split_input": "rowwise_split_input", "packed_colwise": "packed_colwise",
    "moe_tp_experts": "experts", "replicated_with_grad_allreduce": "partial_grad",
    "embedding_rowwise": "rowwise", "embedding_colwise": "colwise",
    "sequence_parallel": "replicate", "local_params": "replicate", "local": "replicate",
    "local_colwise": "replicate", "local_rowwise": "replicate", "local_packed_rowwise": "replicate",
    "replicate": "replicate", "gather": "replicate", "isolated": "replicate",
}
"""Hugging Face `base_model_tp_plan` styles -> paratrain's. The replicated ones stay exact (a layer left whole
computes what it computed); sequence parallelism only saves activation memory."""

HF_EP_EXPERTS = "ep_dispatch_experts"
"""The Hugging Face `base_model_ep_plan` style of an experts module (transformers 5.25 moved the experts there from
`base_model_tp_plan`); its weights are `grouped_gemm` there, split on the expert dimension, which says nothing of
how tensor parallelism splits each expert: `expert_styles` reads that from the module."""

LOCAL_REASON = "tensor parallel (local shards)"
"""Why `_forwards` records the replaced forward of a layer that runs on its local pieces."""

FUSED_PARTS = {"qkv": 3, "c_attn": 3, "wqkv": 3, "Wqkv": 3, "query_key_value": 3, "in_proj": 3, "qkv_proj": 3,
               "gate_up_proj": 2, "gate_up": 2, "w13": 2, "fc1_gate_up": 2}
"""How many equal parts a fused projection of this name packs along its output."""


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's GPT-2 `Conv1D`: a Linear whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _weight(module: nn.Module) -> torch.Tensor:
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def out_features(module: nn.Module) -> int:
    if isinstance(module, nn.Embedding):
        return int(module.embedding_dim)
    return int(_weight(module).shape[1 if is_conv1d(module) else 0])


def in_features(module: nn.Module) -> int:
    if isinstance(module, nn.Embedding):
        return int(module.num_embeddings)
    return int(_weight(module).shape[0 if is_conv1d(module) else 1])


def parts(name: str) -> int:
    """Equal parts of a fused projection (by its attribute name; 2 where the name says nothing)."""
    return FUSED_PARTS.get(name.rpartition(".")[2], 2)


class _SumForward(torch.autograd.Function):
    """Megatron's g: all-reduce in the forward (partial sums -> whole), identity in the backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _SumBackward(torch.autograd.Function):
    """Megatron's f: identity in the forward, all-reduce of the gradient in the backward (a whole input feeding
    split weights gets a partial gradient from each rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


@dataclass(frozen=True)
class PartsOf:
    """A placement for a packed 1-D weight (a fused projection's bias): whole on every tensor rank, each computing
    with its slice of every part. FSDP then splits it like any whole tensor; a strided split of its one dimension
    would leave FSDP no other dimension to split, and DTensor cannot gather two strided splits of one dimension."""

    parts: int


@contextmanager
def local_parameters(module: nn.Module, sliced: dict[str, int], group: Any,
                     sum_grads: frozenset[str]) -> Iterator[None]:
    """Inside, the module's DTensor parameters read as their local pieces (differentiably: gradients reach the
    DTensors), those in `sliced` as this rank's slice of each of their parts (their gradient summed over the ranks,
    each of which filled its slice), and the whole parameters named in `sum_grads` through f (each rank's gradient
    is its share's, summed over the ranks); whatever FSDP has put there is read, so a gathered unit's current
    tensors are used."""
    saved = {n: p for n, p in module._parameters.items()
             if p is not None and (hasattr(p, "to_local") or n in sum_grads)}
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    for name, p in saved.items():
        if not hasattr(p, "to_local"):
            module._parameters[name] = _SumBackward.apply(p, group)  # type: ignore[assignment]
            continue
        local = p.to_local()
        if name in sliced:
            pieces = _SumBackward.apply(local, group).view(sliced[name], size, -1)
            local = pieces[:, rank].reshape(-1)
        module._parameters[name] = local  # type: ignore[assignment]
    try:
        yield
    finally:
        module._parameters.update(saved)


def _parallel_style() -> type:
    from torch.distributed.tensor.parallel import ParallelStyle

    return ParallelStyle  # type: ignore[no-any-return]


class LocalShards(_parallel_style()):  # type: ignore[misc]
    """A torch ParallelStyle: each named parameter becomes a DTensor with its placement (`PartsOf`: whole), and the
    forward runs on the local pieces: floating inputs through f when they come whole (`whole_input`), the output
    through g when each rank holds a partial sum (`sum_output`, then `bias_after_sum` added once), its whole
    parameters' gradients summed over the ranks (`sum_grads`: each rank computed them for its share)."""

    def __init__(self, placements: dict[str, Any], *, whole_input: bool = False, sum_output: bool = False,
                 compute: Callable[..., Any] | None = None, bias_after_sum: str | None = None,
                 sum_grads: frozenset[str] = frozenset()) -> None:
        self.placements, self.whole_input, self.sum_output = placements, whole_input, sum_output
        self.compute, self.bias_after_sum, self.sum_grads = compute, bias_after_sum, sum_grads

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from torch.distributed.tensor import Replicate, distribute_tensor

        sliced = {n: p.parts for n, p in self.placements.items() if isinstance(p, PartsOf)}
        for name, placement in self.placements.items():
            p = module._parameters.get(name)
            if p is None:
                continue
            placement = Replicate() if isinstance(placement, PartsOf) else placement
            shared = distribute_tensor(p.detach(), device_mesh, [placement], src_data_rank=self.src_data_rank)
            module._parameters[name] = nn.Parameter(shared, requires_grad=p.requires_grad)
        group = device_mesh.get_group()
        inner = module.forward
        compute = self.compute or (lambda m, *a, **k: inner(*a, **k))

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.whole_input:
                args = tuple(_SumBackward.apply(a, group) if _floating(a) else a for a in args)
                kwargs = {k: _SumBackward.apply(v, group) if _floating(v) else v for k, v in kwargs.items()}
            with local_parameters(module, sliced, group, self.sum_grads):
                out = compute(module, *args, **kwargs)
                if self.sum_output:
                    out = _SumForward.apply(out, group)
                    if self.bias_after_sum and getattr(module, self.bias_after_sum, None) is not None:
                        out = out + getattr(module, self.bias_after_sum)
            return out

        _forwards.replace(module, forward, LOCAL_REASON)
        return module


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _conv1d(module: nn.Module, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """Conv1D's math on whatever its weight holds now: x @ W (+ b), the last dimension the local width."""
    out = x.reshape(-1, x.shape[-1]) @ _weight(module)
    if bias and isinstance(module.bias, torch.Tensor):
        out = out + module.bias
    return out.view(*x.shape[:-1], out.shape[-1])


def make(style: str, module: nn.Module, name: str) -> Any:
    """The ParallelStyle for `module` (at `name`) in `style`; refuses a layer the style cannot shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    kind = type(module).__name__
    if style == "experts":
        return _experts(module, name)
    if style == "partial_grad":
        return LocalShards({}, sum_grads=frozenset(module._parameters))
    if is_conv1d(module):
        if style in ("colwise", "packed_colwise"):
            weight = _StridedShard(1, split_factor=parts(name)) if style == "packed_colwise" else Shard(1)
            bias = PartsOf(parts(name)) if style == "packed_colwise" else Shard(0)
            return LocalShards({"weight": weight, "bias": bias}, whole_input=True, sum_output=False, compute=_conv1d)
        if style == "rowwise":
            return LocalShards({"weight": Shard(0), "bias": Replicate()}, whole_input=False, sum_output=True,
                               compute=lambda m, x: _conv1d(m, x, bias=False), bias_after_sum="bias")
    elif isinstance(module, nn.Linear):
        if style == "packed_colwise":
            return LocalShards({"weight": _StridedShard(0, split_factor=parts(name)), "bias": PartsOf(parts(name))},
                               whole_input=True,
                               sum_output=False, compute=lambda m, x: nn.functional.linear(x, m.weight, m.bias))
        if style == "colwise":
            return ColwiseParallel()
        if style == "rowwise":
            return RowwiseParallel()
        if style == "colwise_gather_output":
            return ColwiseParallel(output_layouts=Replicate())
        if style == "rowwise_split_input":
            return RowwiseParallel(input_layouts=Replicate())
    elif isinstance(module, nn.Embedding):
        if style == "colwise":
            return ColwiseParallel()
        if style == "rowwise":
            return RowwiseParallel(input_layouts=Replicate())
    raise ParatrainError(f"tensor parallelism: {name} is a {kind}, which the style {style!r} cannot shard (it "
                         "shards nn.Linear, Hugging Face's Conv1D and nn.Embedding, and `experts` modules holding "
                         "3-D expert weights); leave it out of tp_plan")


EXPERT_PLACEMENTS: dict[str, str | int] = {"packed_colwise": "strided", "colwise": 1, "rowwise": 2}
"""Where a 3-D expert weight (experts, out, in) is split, by its Hugging Face style: `packed_colwise` (gate and
up fused along `out`) a slice of each half of `out`, `colwise` along `out`, `rowwise` along `in`."""


_USUAL_EXPERT_STYLES = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise", "w1": "colwise", "w3": "colwise",
                        "w2": "rowwise", "up_proj": "colwise", "gate_proj": "colwise"}


def expert_styles(module: nn.Module) -> dict[str, str] | None:
    """The Hugging Face styles splitting every weight of an experts module by its name (`gate_up_proj` packed, or
    column-wise where Hugging Face interleaves gate and up, `down_proj` row-wise, ...); None where one cannot be split
    that way (weights stored transposed, a bias, a norm inside the module): the module then stays whole."""
    params = dict(module.named_parameters(recurse=False))
    nested = any(True for child in module.children() for _ in child.parameters())
    if not params or nested or getattr(module, "is_transposed", False):
        return None
    styles = {n: _USUAL_EXPERT_STYLES.get(n) for n, p in params.items() if p.dim() == 3}
    if len(styles) != len(params) or None in styles.values():
        return None
    if styles.get("gate_up_proj") and getattr(module, "is_concatenated", True) is False:
        styles["gate_up_proj"] = "colwise"  # [gate0, up0, gate1, up1, ...]: a contiguous slice keeps the pairs
    return {n: s for n, s in styles.items() if s is not None}


def experts_placements(module: nn.Module, declared: dict[str, str], name: str) -> dict[str, Any]:
    """Placements of an experts module's weights from their declared styles ({parameter: HF style}), or, declared
    nothing, the usual layout: `gate_up_proj` packed, `down_proj` row-wise, or `w1`/`w3` column-wise and `w2`
    row-wise."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    params = dict(module.named_parameters(recurse=False))
    if not declared:
        declared = {k: v for k, v in _USUAL_EXPERT_STYLES.items() if k in params}
    found: dict[str, Any] = {}
    for pname, style in declared.items():
        p = params.get(pname)
        where = EXPERT_PLACEMENTS.get(style)
        if p is None or p.dim() != 3 or where is None:
            raise ParatrainError(
                f"tensor parallelism: the experts of {name or 'the model'} ({type(module).__name__}) declare "
                f"{pname!r} as {style!r}, but paratrain splits 3-D expert weights (experts, out, in) packed, "
                f"column- or row-wise; its parameters: {sorted(params)}")
        found[pname] = _StridedShard(1, split_factor=2) if isinstance(where, str) else Shard(where)
    extra = sorted(n for n in params if n not in found)
    if extra or not found:
        raise ParatrainError(
            f"tensor parallelism: {name} ({type(module).__name__}) holds {extra or 'no'} expert parameters beside "
            "the split weights; a bias of a row-wise expert weight would be added once per tensor rank. Leave the "
            "experts out of tp_plan (they stay whole on every rank), or use a data-parallel layout")
    return found


def _experts(module: nn.Module, name: str, declared: dict[str, str] | None = None) -> LocalShards:
    placements = experts_placements(module, declared or {}, name)
    return LocalShards(placements, whole_input=True, sum_output=True)


def experts(module: nn.Module, name: str, declared: dict[str, str]) -> LocalShards:
    """The `experts` style with the weights' placements declared by a Hugging Face plan."""
    return _experts(module, name, declared)


def own_parameters(module: nn.Module, name: str, declared: dict[str, str]) -> LocalShards:
    """A module's own parameters split by their declared styles (a per-head attention sink, `colwise`: its heads
    split with the projections'), its forward run on the local pieces."""
    from torch.distributed.tensor import Shard

    where = {"colwise": 0, "rowwise": -1}
    wrong = {p: s for p, s in declared.items() if s not in where}
    if wrong:
        raise ParatrainError(f"tensor parallelism: {name} declares its parameters {wrong}; a module's own parameter "
                             "is split colwise (dim 0) or rowwise (its last dim)")
    return LocalShards({p: Shard(where[s]) for p, s in declared.items()})
