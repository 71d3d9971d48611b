"""Degrees of parallelism as data: one `ParallelDims` per run, validated once, building one named mesh.

A strategy string is a grammar: any `+`-joined set of `ddp` (replicas), `fsdp` (shards), `tp` (tensor), `cp`
(context: the sequence), `ep` (experts) and `pp` (pipeline). Degrees come from `tp_size`, `cp_size`, `pp_size`,
`ep_size` and `dp_replicate`; the data-parallel axes take the rest of the world. Ranks are laid out with the
pipeline outermost and the tensor axis innermost (tensor-parallel ranks talk every layer, so they are neighbours,
on one node), context-parallel ranks next to them, as torchtitan's `ParallelDims` does:

    world 8 = pp 2 x dp_shard 2 x tp 2      rank = (((pp * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t

The expert axis adds no ranks: it is carved from the data-parallel ones (from `dp_shard` where there is one, else
from the replicas), the expert group innermost, so ranks that load different rows also hold different experts:

    "fsdp+ep", world 4, ep 2:   s = m * ep + e      expert groups {0, 1}, {2, 3}; same experts on {0, 2}, {1, 3}
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..errors import ParatrainError

AXES = ("ddp", "fsdp", "tp", "cp", "ep", "pp")
"""The words of the grammar, in the order a canonical name lists them."""

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Mesh dimensions, outermost first."""

DEFAULT_SPLIT = 2
"""Degree of `tp` or `pp` when it is not given and another axis takes the rest of the world."""


def is_grammar(name: str) -> bool:
    """Whether `name` is for the grammar to read (callers look their preset names up first)."""
    return "+" in name or name in AXES


def parse(name: str) -> tuple[str, ...]:
    """The axes a strategy name asks for, in canonical order; refuses unknown or repeated words."""
    words = [w.strip() for w in name.split("+")]
    unknown = [w for w in words if w not in AXES]
    if unknown or len(set(words)) != len(words) or not words:
        raise ParatrainError(
            f"strategy {name!r}: an N-D strategy is a '+'-joined set of {', '.join(AXES)} with each word once "
            f"(e.g. 'fsdp+tp', 'ddp+fsdp', 'fsdp+tp+pp'){'; unknown: ' + ', '.join(unknown) if unknown else ''}")
    return tuple(a for a in AXES if a in words)


def canonical(name: str) -> str:
    return "+".join(parse(name))


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    """Expert-parallel ranks: carved from the data-parallel ones (`expert_axis`), so not a factor of the world."""
    cp: int = 1
    """Context-parallel ranks: one replica's rows, each a share of every sequence (`parallel.context`)."""

    @property
    def expert_axis(self) -> str:
        """The data-parallel mesh dimension the expert groups are cut from."""
        return "dp_shard" if self.dp_shard > 1 else "dp_replicate"

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the model: each loads its own share of the global batch."""
        return self.dp_replicate * self.dp_shard

    def refused(self) -> str | None:
        """Why these degrees are not built together (None: they are). The strategy refuses by it and the planner
        leaves such layouts out by it: one answer for both."""
        if self.ep > 1 and self.cp > 1:
            return ("expert parallelism beside context parallelism is not built (the experts would see each rank's "
                    "share of the tokens); drop 'ep' or 'cp'")
        return None

    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                "tp": self.tp}

    def describe(self) -> str:
        experts = f" (ep {self.ep} of {self.expert_axis})" if self.ep > 1 else ""
        return (" x ".join(f"{k} {v}" for k, v in self.sizes().items() if v > 1) or "one worker") + experts

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where `rank` sits on each mesh dimension (the tensor axis innermost)."""
        coords: dict[str, int] = {}
        for axis in reversed(MESH_ORDER):
            size = self.sizes()[axis]
            coords[axis] = rank % size
            rank //= size
        return coords

    def data_shard(self, rank: int) -> tuple[int, int]:
        """(replica index, replica count): tensor-, context- and pipeline-parallel ranks of one replica load the same
        rows."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"], self.dp

    def replica_groups(self) -> tuple[tuple[int, ...], ...]:
        """The ranks that load different rows of one step: one group per position on the model axes (pp, cp, tp),
        each its data-parallel ranks in order. Arithmetic only, so every rank knows every group without a
        collective."""
        groups: dict[tuple[int, int, int], list[int]] = {}
        for rank in range(self.world):
            c = self.coordinates(rank)
            groups.setdefault((c["pp"], c["cp"], c["tp"]), []).append(rank)
        return tuple(tuple(ranks) for ranks in groups.values())

    def build_mesh(self, device_type: str) -> Any:
        """One DeviceMesh over the whole world, with a named dimension per axis (size-1 axes included, so code
        can always ask for `mesh["tp"]`)."""
        from torch.distributed.device_mesh import init_device_mesh

        sizes = self.sizes()
        return init_device_mesh(device_type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))

    def build_expert_mesh(self, device_type: str) -> tuple[Any, Any]:
        """The meshes of expert parallelism, the data-parallel axis the experts are carved from split in two: the
        expert group (1-D, "ep"), and the ranks holding the same experts (1-D, "ep_replicas"). Collective, like
        `build_mesh`."""
        from torch.distributed.device_mesh import init_device_mesh

        shard = self.expert_axis == "dp_shard"
        outer = (self.dp_replicate, self.dp_shard // self.ep) if shard else (self.dp_replicate // self.ep, 1)
        names = ("pp", "ep_replicate", "ep_shard", "ep", "tp")
        mesh = init_device_mesh(device_type, (self.pp, *outer, self.ep, self.tp), mesh_dim_names=names)
        return mesh["ep"], mesh["ep_replicate", "ep_shard"]._flatten("ep_replicas")


def dims_for(name: str, world: int, *, tp_size: int | None = None, pp_size: int | None = None,
             dp_replicate: int | None = None, ep_size: int | None = None, cp_size: int | None = None) -> ParallelDims:
    """The degrees `name` asks for on `world` workers, or a refusal with every factor and the fix."""
    dims = _model_and_data(name, world, tp_size=tp_size, pp_size=pp_size, dp_replicate=dp_replicate, cp_size=cp_size)
    if ep_size is not None and ep_size > 1 and "ep" not in parse(name):
        raise ParatrainError(f"strategy {name!r} has no ep axis but ep_size={ep_size}; use strategy "
                             f"'{canonical(name + '+ep')}' or drop ep_size")
    if "ep" not in parse(name):
        return dims
    carved = dims.dp_shard if dims.expert_axis == "dp_shard" else dims.dp_replicate
    ep = ep_size or carved
    if ep < 2 or carved % ep:
        raise ParatrainError(
            f"strategy {name!r} on world {world}: ep {ep} must be at least 2 and divide the {carved} ranks of "
            f"{dims.expert_axis} ({dims.describe()}) it is carved from; use an ep_size that divides {carved}, or "
            "launch more workers")
    return replace(dims, ep=ep)


def _model_and_data(name: str, world: int, *, tp_size: int | None, pp_size: int | None,
                    dp_replicate: int | None, cp_size: int | None) -> ParallelDims:
    axes = tuple(a for a in parse(name) if a != "ep")
    if not any(a in ("ddp", "fsdp") for a in axes) and "ep" in parse(name):
        axes = ("ddp", *axes)  # experts are carved from data-parallel ranks: replicas, where none is named
    data = [a for a in axes if a in ("ddp", "fsdp")]
    for flag, value, axis in (("tp_size", tp_size, "tp"), ("pp_size", pp_size, "pp"), ("cp_size", cp_size, "cp")):
        if value is not None and value > 1 and axis not in axes:
            raise ParatrainError(f"strategy {name!r} has no {axis} axis but {flag}={value}; "
                                 f"use strategy '{canonical(name + '+' + axis)}' or drop {flag}")
    if dp_replicate is not None and dp_replicate > 1 and axes != ("ddp",) and set(data) != {"ddp", "fsdp"}:
        raise ParatrainError(f"dp_replicate={dp_replicate} sets the replicas of hybrid sharding: use strategy "
                             f"'{canonical('+'.join(['ddp', 'fsdp', *[a for a in axes if a not in data]]))}'")
    tp = tp_size or (1 if "tp" not in axes else None)
    pp = pp_size or (1 if "pp" not in axes else None)
    if tp is None and pp is None:
        pp = DEFAULT_SPLIT
    cp = cp_size or (1 if "cp" not in axes else None)
    if cp is None:
        cp = DEFAULT_SPLIT if data or tp is None or pp is None else world // (tp * pp)
    rest = world // ((tp or 1) * (pp or 1) * cp)
    if tp is None:
        tp = DEFAULT_SPLIT if data else rest
    if pp is None:
        pp = DEFAULT_SPLIT if data else rest
    model = tp * pp * cp
    factors = f"tp {tp} x pp {pp}" + (f" x cp {cp}" if cp > 1 else "")
    if world % model:
        raise ParatrainError(
            f"strategy {name!r}: world {world} is not a multiple of {factors} = {model}; launch a multiple of {model} "
            f"workers, or choose {'tp_size/pp_size/cp_size' if cp > 1 else 'tp_size/pp_size'} that divide {world}")
    dp = world // model
    replicate, shard = 1, 1
    if data == ["ddp"]:
        replicate = dp
    elif data == ["fsdp"]:
        shard = dp
    elif data:
        replicate = dp_replicate or DEFAULT_SPLIT
        if dp % replicate:
            raise ParatrainError(
                f"strategy {name!r}: {dp} data-parallel workers (world {world} / tp {tp} / pp {pp}) cannot form "
                f"{replicate} replicas of equal shard groups; use a dp_replicate that divides {dp}")
        shard = dp // replicate
    dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, tp=tp, pp=pp, cp=cp)
    degrees = {"ddp": replicate, "fsdp": shard, "tp": tp, "pp": pp, "cp": cp}
    lone = [a for a in axes if degrees[a] < 2]
    if lone or dp > 1 and not data:
        got = (f"{', '.join(f'{a} {degrees[a]}' for a in lone)} leaves that axis idle" if lone
               else f"{factors} = {model} covers only part of world {world}")
        fix = ("every named axis needs a degree of at least 2 and the degrees must multiply to the world: launch "
               "more workers, change tp_size/pp_size, or name fewer axes")
        if lone and set(lone) <= {"ddp", "fsdp"} and model > 1:  # one replica of the model: say which layout that is
            model_axes = "+".join(a for a in axes if a not in data)
            fix = (f"2 replicas of its {model}-worker model ({factors}) need a world size >= {2 * model} that is a "
                   f"multiple of {model}, got {world}: launch more workers, or use strategy {model_axes!r} for one "
                   "replica")
        raise ParatrainError(f"strategy {name!r} on world {world}: {got} ({dims.describe()}); {fix}")
    return dims
