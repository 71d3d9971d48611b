"""Alpha-beta models of the collectives the strategies use, and where each group's traffic goes.

A ring over p workers moves each byte through p-1 links and takes p-1 latency steps per phase:

    all-reduce      2(p-1)/p * n * beta + 2(p-1) * alpha     (reduce-scatter, then all-gather)
    all-gather        (p-1)/p * n * beta +  (p-1) * alpha     (n: the gathered size)
    reduce-scatter    (p-1)/p * n * beta +  (p-1) * alpha     (n: the size before scattering)
    all-to-all        (p-1)/p * n * beta +  (p-1) * alpha     (n: what one worker sends in all; pairwise exchange,
                                                              each worker keeps 1/p and sends 1/p to each other one)
    point-to-point              n * beta +         alpha

beta is 1 / the per-device bandwidth of the slowest link the group crosses: NVLink (or the loopback of
CPU workers) inside a node, the network between nodes. On the machine at hand the alphas and betas are
fitted per collective from a sweep over message sizes (`calibrate.py`), so gloo's own algorithms are
measured rather than assumed; elsewhere they come from the cluster spec.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cluster import COLLECTIVES, Cluster, Link

__all__ = ["COLLECTIVES", "Group", "collective_time", "fit", "p2p_time", "steps", "time", "volume"]


def steps(kind: str, p: int) -> int:
    """Latency terms of one collective over p workers (a ring's steps; all-to-all's p-1 pairwise exchanges)."""
    if kind == "p2p":
        return 1
    return 2 * (p - 1) if kind == "all_reduce" else p - 1


def volume(kind: str, p: int, n: float) -> float:
    """Bytes each worker sends (and receives) for a collective of n bytes over p workers."""
    if kind == "p2p":
        return n
    share = (p - 1) / p * n
    return 2 * share if kind == "all_reduce" else share


def time(kind: str, n: float, p: int, alpha: float, beta: float) -> float:
    """Seconds for `kind` on n bytes over p workers, with latency alpha and seconds-per-byte beta."""
    if p <= 1 or n <= 0:
        return 0.0
    return steps(kind, p) * alpha + volume(kind, p, n) * beta


@dataclass(frozen=True)
class Group:
    """A process group as the network sees it: its size and whether it crosses nodes."""

    size: int
    crosses_nodes: bool


def pipeline_groups(cluster: Cluster, dp: int, pp: int, tp: int = 1) -> tuple[Group, Group]:
    """(data-parallel group, pipeline group) on the one N-D mesh (`parallel.dims`: the pipeline axis outermost,
    the tensor axis innermost): replicas of a rank are tp apart, pipeline neighbours dp x tp apart, so a
    pipeline crosses nodes before its replicas do (Megatron's and torchtitan's order)."""
    per_node = cluster.devices_per_node
    return Group(dp, dp > 1 and dp * tp > per_node), Group(pp, pp > 1 and dp * tp * pp > per_node)


def tensor_group(cluster: Cluster, tp: int) -> Group:
    """Tensor ranks are the innermost mesh axis: neighbours on one node unless tp exceeds a node."""
    return Group(tp, tp > cluster.devices_per_node)


def context_group(cluster: Cluster, cp: int, tp: int = 1) -> Group:
    """Context ranks sit next to the tensor axis (`parallel.dims`: cp x tp innermost), cp of them tp apart."""
    return Group(cp, cp > 1 and cp * tp > cluster.devices_per_node)


def expert_group(cluster: Cluster, ep: int) -> Group:
    """The expert group is the innermost part of the data-parallel axis it is carved from: ep neighbours."""
    return Group(ep, ep > cluster.devices_per_node)


def link_of(cluster: Cluster, group: Group) -> Link:
    return cluster.inter if group.crosses_nodes else cluster.intra


def collective_time(cluster: Cluster, kind: str, n: float, group: Group) -> float:
    """Seconds for one collective of n bytes over `group` on `cluster`."""
    if group.size <= 1 or n <= 0:
        return 0.0
    fitted = cluster.collectives.get(kind)
    if fitted is not None and not group.crosses_nodes:
        return time(kind, n, group.size, *fitted)
    link = link_of(cluster, group)
    return time(kind, n, group.size, link.latency, 1.0 / link.bandwidth)


def p2p_time(cluster: Cluster, n: float, crosses_nodes: bool = False) -> float:
    return collective_time(cluster, "p2p", n, Group(2, crosses_nodes))


def fit(kind: str, p: int, points: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha, beta) of `kind` over p workers from measured (bytes, seconds): least squares on the ring
    formula in relative error (weights 1/t^2), so the small messages set the latency and the large ones
    the bandwidth; both are kept non-negative."""
    k = steps(kind, p)
    xs = [volume(kind, p, n) for n, _ in points]
    ys = [t for _, t in points]
    ws = [1.0 / (t * t) if t > 0 else 0.0 for t in ys]
    sw = sum(ws)
    mean_x = sum(w * x for w, x in zip(ws, xs)) / sw
    mean_y = sum(w * y for w, y in zip(ws, ys)) / sw
    sxx = sum(w * (x - mean_x) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mean_x) * (y - mean_y) for w, x, y in zip(ws, xs, ys)) / sxx if sxx else 0.0
    slope = max(slope, 0.0)
    intercept = mean_y - slope * mean_x
    if intercept < 0:  # latency below what the sweep can see: refit the bandwidth through the origin
        intercept = 0.0
        slope = sum(w * x * y for w, x, y in zip(ws, xs, ys)) / sum(w * x * x for w, x in zip(ws, xs))
    return intercept / k, slope
