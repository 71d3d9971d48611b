"""Cutting a traced model into segments between its layers, each a module a pipeline stage can run.

The candidate cuts are the model's layers in its own names: top-level children, and each item of a
container of repeated blocks (`nn.ModuleList`, `nn.ModuleDict`, `nn.Sequential`, also inside a child
that holds one, as Hugging Face models hold `transformer.h` or `model.layers`), as torchtitan and
Megatron cut transformers by layer. Every node of the traced graph belongs to the layer it ran in;
code of the model's own forward (adding two embeddings, the residual stream) goes with the layer
before it. A segment is the run of nodes from one layer's first node to the next layer's first node.

Values cross from one segment to the next as a flat tuple: everything defined before the cut and used
after it, so several values (token and position embeddings), values that skip over segments (a
residual, an attention mask every block reads) and dicts or tuples (flattened to their tensors) all
pass. An integer the graph computed from a batch size (`b = x.size(0)` before `x.view(b, t, h, d)`, or
`b * heads`) is not sent but computed again from the sizes of the tensors that cross with it, so the graph
stays valid at any batch size; any other integer crosses as a 0-d tensor (`crossing`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ...errors import ParatrainError
from ..batchnorm import defer_graph
from . import graph_randomness
from .crossing import Crossing, crossing, receive, send
from .tracing import Traced, module_path

CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _holds_container(module: nn.Module) -> bool:
    return any(isinstance(m, CONTAINERS) for m in module.modules() if m is not module)


def _holds_layers(module: nn.Module) -> bool:
    """A module the cuts go inside (`unit_paths` descends into it): a segment holds its tensors, not all of it."""
    return isinstance(module, CONTAINERS) or _holds_container(module)


def unit_paths(model: nn.Module, prefix: str = "") -> list[str]:
    """The layers a pipeline may cut between, outermost first, in the model's own names."""
    out: list[str] = []
    for name, child in model.named_children():
        path = prefix + name
        if isinstance(child, CONTAINERS):
            out += [f"{path}.{item}" for item, _ in child.named_children()]
        elif _holds_container(child):
            out += unit_paths(child, path + ".")
        else:
            out.append(path)
    return out


def _unit_of(node: fx.Node, units: set[str]) -> str | None:
    for path in reversed(module_path(node)):
        if path in units:
            return path
    return None


def _is_value(node: fx.Node) -> bool:
    return node.op in ("placeholder", "call_function", "call_method", "call_module") and node.target != "_guards_fn"


def _compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if _is_value(n) and n.op != "placeholder"]


def unit_order(gm: fx.GraphModule, units: list[str]) -> list[str]:
    """The layers that run, in the order their first node runs."""
    known, order = set(units), []
    for node in _compute_nodes(gm):
        unit = _unit_of(node, known)
        if unit is not None and unit not in order:
            order.append(unit)
    return order


def assign(gm: fx.GraphModule, order: list[str]) -> dict[fx.Node, int]:
    """Segment index of every compute node: its layer's, or the segment current when it runs."""
    index = {unit: i for i, unit in enumerate(order)}
    current, out = 0, {}
    for node in _compute_nodes(gm):
        unit = _unit_of(node, set(order))
        if unit is not None and index[unit] > current:
            current = index[unit]
        out[node] = current
    return out


def _boundaries(gm: fx.GraphModule, seg: dict[fx.Node, int], count: int) -> list[Crossing]:
    """What crosses each of the `count - 1` cuts."""
    values = [n for n in gm.graph.nodes if _is_value(n)]
    defined = {n: (-1 if n.op == "placeholder" else seg[n]) for n in values}

    def last_use(node: fx.Node) -> int:
        return max((count if u.op == "output" else seg.get(u, -1) for u in node.users), default=-1)

    uses = {n: last_use(n) for n in values}
    return [crossing([n for n in values if defined[n] <= k < uses[n]]) for k in range(count - 1)]


def _segment_graph(gm: fx.GraphModule, nodes: list[fx.Node], inputs: Crossing | None,
                   outputs: Crossing | None, training: bool) -> fx.GraphModule:
    """The nodes of one segment as a graph: inputs are the sent values (or the model's flat inputs).

    A sent value that the segment also uses itself (a residual cut between a block's two halves) is sent
    as a copy when training: zero-bubble schedules compute the input gradients first and then detach the
    stage's outputs in place (torch's stage_backward_input), and the weight gradients that follow need
    the value as the segment's own nodes saved it."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env:
            if node.op != "get_attr":
                raise ParatrainError(f"internal: value {node.name} is not available in this pipeline segment")
            env[node] = graph.get_attr(node.target)  # type: ignore[arg-type]
        return env[node]

    if inputs is None:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = graph.placeholder(node.name)
                env[node].meta = dict(node.meta)
    else:
        receive(graph, inputs, env, lookup)
    for node in nodes:
        env[node] = graph.node_copy(node, lookup)
    if outputs is None:
        (result,) = next(n for n in gm.graph.nodes if n.op == "output").args
        graph.output(pytree.tree_map(lambda n: lookup(n) if isinstance(n, fx.Node) else n, result))
    else:
        inside = set(nodes)

        def sent(node: fx.Node) -> fx.Node:
            if training and any(u in inside for u in node.users):
                return graph.call_function(torch.clone, (lookup(node),))
            return lookup(node)

        graph.output(send(graph, outputs, sent, lookup))
    graph.lint()
    return fx.GraphModule(gm, graph)


def _move_device_literals(gm: fx.GraphModule, old: torch.device, new: torch.device) -> None:
    """Every device argument equal to `old` in the graph's calls becomes `new`, also in the subgraphs of its
    higher-order calls (torch.export wraps a `no_grad` region as `wrap_with_set_grad_enabled(False, submod)`)."""
    def swap(value: Any) -> Any:
        return new if isinstance(value, torch.device) and value == old else value

    for graph_module in [m for m in gm.modules() if isinstance(m, fx.GraphModule)]:
        for node in graph_module.graph.nodes:
            node.args = fx.node.map_aggregate(node.args, swap)
            node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
        graph_module.recompile()


def _is_param(model: nn.Module, target: str) -> bool:
    owner, _, attr = target.rpartition(".")
    return attr in (model.get_submodule(owner) if owner else model)._parameters


def _has(root: nn.Module, target: str) -> bool:
    try:
        root.get_parameter(target)
        return True
    except AttributeError:
        return False


def _attach_tensor(owner: nn.Module, path: str, value: torch.Tensor, model: nn.Module) -> None:
    """Register one parameter or buffer at `path` under fresh parents (persistence as in `model`)."""
    parent_path, _, attr = path.rpartition(".")
    node = owner
    for part in parent_path.split(".") if parent_path else []:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]  # type: ignore[assignment]
    if isinstance(value, nn.Parameter):
        node.register_parameter(attr, value)
    else:
        source = model.get_submodule(parent_path) if parent_path else model
        node.register_buffer(attr, value, persistent=attr not in source._non_persistent_buffers_set)


def _attach(owner: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` at dotted `path` under `owner`, creating empty parents as needed."""
    *parents, name = path.split(".")
    node = owner
    for part in parents:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]  # type: ignore[assignment]
    if name not in node._modules:
        node.add_module(name, module)


def _calls_layer(node: fx.Node, model: nn.Module) -> bool:
    """A call of one of the user's modules: a tensor-parallel layer the graph runs as itself (tensor.traced)."""
    if node.op != "call_module":
        return False
    try:
        model.get_submodule(str(node.target))
    except AttributeError:
        return False
    return True


def _belongs_to(model: nn.Module, target: str) -> bool:
    """A parameter or buffer of the user's model (not a submodule or constant the tracer made)."""
    owner, _, attr = target.rpartition(".")
    try:
        holder = model.get_submodule(owner) if owner else model
    except AttributeError:
        return False
    return attr in holder._parameters or attr in holder._buffers


class GraphSegment(nn.Module):
    """One segment of a traced model, holding the user's modules it uses under their own paths.

    It runs its training graph or its evaluation graph by its mode; both refer to the same parameters.
    The first segment takes the model's input as the user passes it; the last returns the model's output
    in the model's own structure (a tensor, a dict, a ModelOutput); the others pass flat tuples.
    """

    def __init__(self, name: str, graphs: dict[bool, fx.GraphModule], model: nn.Module, specs: dict[bool, Any],
                 first: bool, last: bool) -> None:
        super().__init__()
        self.name, self.first, self.last = name, first, last
        self._graphs = graphs  # unregistered: the user's modules are registered below, by path
        self._specs = specs
        targets = sorted({str(n.target) for gm in graphs.values() for n in gm.graph.nodes
                          if n.op == "get_attr" and _belongs_to(model, str(n.target))}, key=lambda t: (t.count("."), t))
        layers = {str(n.target) for gm in graphs.values() for n in gm.graph.nodes if _calls_layer(n, model)}
        # shallower modules first, so a parent is the user's module rather than an empty one made for a child
        for target in sorted(set(targets) | layers, key=lambda t: (t.count(".") + (t in layers), t)):
            owner, _, attr = target.rpartition(".")
            holder = model.get_submodule(owner) if owner else model
            if target in layers:
                _attach(self, target, model.get_submodule(target))
            elif owner and not _holds_layers(holder):
                _attach(self, owner, holder)
            else:  # a tensor of the model itself, or of a module holding layers (ViT's encoder.pos_embedding): that
                _attach_tensor(self, target, getattr(holder, attr), model)  # tensor alone, not the layers around it
        used = {id(self.get_parameter(t)) if _is_param(model, t) else None for t in targets} - {None}
        for name, p in model.named_parameters(remove_duplicate=False):  # other names of a tied weight
            if id(p) in used and not _has(self, name):
                _attach_tensor(self, name, p, model)
        self._targets = targets
        self._links = {training: self._find_links(gm) for training, gm in graphs.items()}
        self._device = self._where()
        self.read_through = False
        """Set where FSDP2 swaps the modules' parameters at each call (`sharded`): the graphs then read every
        tensor from its module before they run, instead of keeping the tensors they were given."""

    def _where(self) -> torch.device | None:
        return next((t.device for t in (*self.parameters(), *self.buffers())), None)

    def _read(self, modes: Iterable[bool]) -> None:
        """Each graph of `modes` (training, evaluation) reads every tensor from the module that holds it now."""
        for training in modes:
            for source, attr, holder, name in self._links[training]:
                value = getattr(source, attr)
                if getattr(holder, name, None) is not value:  # FSDP2 swaps sharded and unsharded Parameters
                    setattr(holder, name, value)

    def _find_links(self, gm: fx.GraphModule) -> list[tuple[nn.Module, str, nn.Module, str]]:
        """(module holding a tensor, its name, module of `gm` holding the graph's copy, its name) per target, found
        once: a traced stage under FSDP reads them at every call, where walking the paths cost 5 ms a step."""
        links = []
        for target in self._targets:
            owner, _, attr = target.rpartition(".")
            *path, name = target.split(".")
            holder: nn.Module = gm
            for part in path:
                holder = getattr(holder, part)
            links.append((self.get_submodule(owner) if owner else self, attr, holder, name))
        return links

    def repoint(self) -> None:
        """After moving (`.to`), buffers are new tensors: the graphs read them from the registered modules, and
        the devices torch.export wrote into the graphs (`arange(..., device=cpu)`, a dtype/device assertion)
        become the stage's, or a model traced on CPU and placed on a GPU mixes the two."""
        self._read(self._graphs)
        where = self._where()
        if where is not None and self._device is not None and where != self._device:
            for gm in self._graphs.values():
                _move_device_literals(gm, self._device, where)
            self._device = where

    def compile_pieces(self) -> list[nn.Module]:
        """What `setup(compile=...)` compiles: each graph apart, so every piece has its own compiled code
        (segments share this class's forward, and one compiled forward for all would recompile per segment)."""
        return list(self._graphs.values())

    def forward(self, value: Any) -> Any:
        gm = self._graphs[self.training]
        if self.read_through:
            self._read([self.training])  # the graph about to run
        in_spec, out_spec = self._specs[self.training]
        if self.first:
            flat, spec = pytree.tree_flatten(((value,), {}))
            if spec != in_spec:
                raise ParatrainError(
                    f"the inputs' structure {spec} differs from the example given to run.prepare ({in_spec}); "
                    "pass inputs with the same keys and nesting as that example"
                )
        else:
            flat = list(value) if isinstance(value, tuple) else [value]
        grad = torch.is_grad_enabled()
        try:
            out = gm(*flat)
        finally:  # an exported graph switches grad mode by calls (`no_grad` regions), not by a `with`
            torch.set_grad_enabled(grad)
        return pytree.tree_unflatten(list(out), out_spec) if self.last else tuple(out)


def traced_segments(model: nn.Module, traced: Traced, defer_batchnorm: bool = False) -> list[tuple[str, nn.Module]]:
    """The traced model cut before each of its layers: (layer names, segment module) in order."""
    name = type(model).__name__
    units = unit_paths(model)
    order = unit_order(traced.train, units)
    if len(order) < 2:
        raise ParatrainError(
            f"{name} has {len(order)} layer(s) a pipeline can cut between (top-level children, or items of "
            "an nn.ModuleList/ModuleDict/Sequential); give it at least 2, or use a data-parallel strategy"
        )
    graphs: dict[bool, list[fx.GraphModule]] = {}
    specs: dict[bool, Any] = {}
    for training, gm in ((True, traced.train), (False, traced.eval)):
        graph_randomness.rewrite(gm, name)
        if defer_batchnorm:
            defer_graph(gm, lambda node: (module_path(node) or [""])[-1])
        seg = assign(gm, order)
        cuts = _boundaries(gm, seg, len(order))
        nodes = [[n for n in _compute_nodes(gm) if seg[n] == k and (n.op != "call_module" or _calls_layer(n, model))]
                 for k in range(len(order))]
        graphs[training] = [_segment_graph(gm, nodes[k], cuts[k - 1] if k else None,
                                           cuts[k] if k < len(order) - 1 else None, training)
                            for k in range(len(order))]
        info = gm.graph._codegen.pytree_info  # type: ignore[attr-defined]
        specs[training] = (info.in_spec, info.out_spec)
    segments: list[tuple[str, nn.Module]] = [
        (unit, GraphSegment(unit, {True: graphs[True][k], False: graphs[False][k]}, model, specs, first=k == 0,
                            last=k == len(order) - 1))
        for k, unit in enumerate(order)]
    _hold_idle(model, segments)
    return segments


def _hold_idle(model: nn.Module, segments: list[tuple[str, nn.Module]]) -> None:
    """Parameters and saved buffers no graph reads (a decoder-only run of a layer's cross-attention) are held by the
    segment of the layer they belong to (the first segment, outside every layer): they get no gradient, as in one
    process, and the checkpoint still holds them."""
    held = {id(t) for _, segment in segments for t in (*segment.parameters(), *segment.buffers())}
    owners = sorted((unit for unit, _ in segments), key=len, reverse=True)
    tensors: list[tuple[str, torch.Tensor]] = list(model.named_parameters())
    tensors += [(n, t) for n, t in model.named_buffers() if _persistent(model, n)]
    for name, tensor in tensors:
        if id(tensor) in held:
            continue
        unit = next((u for u in owners if name.startswith(f"{u}.")), None)
        segment = dict(segments)[unit] if unit is not None else segments[0][1]
        _attach_tensor(segment, name, tensor, model)
        held.add(id(tensor))


def _persistent(model: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return attr not in (model.get_submodule(owner) if owner else model)._non_persistent_buffers_set


__all__ = ["GraphSegment", "traced_segments", "unit_paths"]
