"""Which layers tensor parallelism shards, and how (the styles of `styles.py`): Megatron's pairs of a "colwise"
layer (output features split over the tensor ranks) feeding a "rowwise" one (input features split, outputs summed),
fused projections split per part, expert weights split per expert.

Plans come, first match wins, from the user (`tp_plan={"blocks.*.attn.q": "colwise", ...}`), from the model's
own declaration (a Hugging Face model's config carries `base_model_tp_plan`, and from transformers 5.25 its experts
in `base_model_ep_plan`; found on the model or on a Hugging Face model the user's module holds), or from the
structure of the usual blocks: q/k/v projections and their output projection, MLP up/gate and down, fused qkv and
gate/up projections. Whatever the source, the plan is resolved to
the user's module names here, so it can be printed, checked and refused by name. A fused projection found by
structure is planned as `fused`: whether its parts are packed one after another (GPT-2's `c_attn`: all of q, then
k, then v) or interleaved per head (GPT-NeoX's `query_key_value`) is a property of the forward, which the check on
the example batch settles (`check.choose`).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any

from torch import nn

from ...errors import ParatrainError
from .styles import HF_EP_EXPERTS, HF_STYLES, STYLES, expert_styles, in_features, is_conv1d, out_features

FUSED = "fused"
"""A structural plan's style for a fused projection: packed or interleaved, settled by the check."""

_QKV = re.compile(r"^(q|k|v|wq|wk|wv|q_proj|k_proj|v_proj|query|key|value|q_lin|k_lin|v_lin|query_proj|key_proj|"
                  r"value_proj|pos_key_proj|pos_query_proj)$")
_OUT = re.compile(r"^(o|wo|o_proj|out_proj|proj|c_proj|dense|out_lin)$")
_UP = re.compile(r"^(w1|w3|up|gate|up_proj|gate_proj|fc1|c_fc|fc_in|lin1|dense_h_to_4h|wi|wi_0|wi_1)$")
_DOWN = re.compile(r"^(w2|down|down_proj|fc2|c_proj|fc_out|lin2|dense_4h_to_h|wo)$")
_FUSED_QKV = re.compile(r"^(qkv|c_attn|wqkv|Wqkv|query_key_value|qkv_proj)$")
_FUSED_UP = re.compile(r"^(gate_up_proj|gate_up|w13)$")


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if _is_linear(m)}


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear, or Hugging Face's GPT-2 Conv1D (a Linear with its weight transposed)."""
    return isinstance(module, nn.Linear) or is_conv1d(module)


def _matches(name: str, atoms: list[str]) -> bool:
    parts = name.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatchcase(a, p) for a, p in zip(parts, atoms, strict=True))


def resolve(model: nn.Module, patterns: dict[str, str], source: str, *, strict: bool = True) -> dict[str, str]:
    """Module (or expert parameter) name -> style for every name a pattern matches (`*` matches one name, as in
    torch's plans). `strict`: a pattern matching nothing is refused (a user's plan); a model's own declaration
    names layers some of its configurations lack (Qwen2-MoE's dense MLPs), which are skipped."""
    plan: dict[str, str] = {}
    modules = [n for n, _ in model.named_modules() if n]
    params = [n for n, _ in model.named_parameters()]
    for pattern, style in patterns.items():
        if style not in STYLES:
            raise ParatrainError(f"tensor parallelism: {source} gives {pattern!r} the style {style!r}; paratrain "
                                 f"shards with {', '.join(STYLES)} (leave other modules out of the plan)")
        atoms = pattern.split(".")
        hits = [n for n in modules if _matches(n, atoms)] or [n for n in params if _matches(n, atoms)]
        if not hits and strict:
            raise ParatrainError(f"tensor parallelism: {source} names {pattern!r}, which matches no module of "
                                 f"{type(model).__name__}; {_listing(model)}")
        for name in hits:
            plan[name] = style
    return {n: s for n, s in plan.items() if s != "replicate"}


def _declaring(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules (the model, or Hugging Face models inside the user's) whose config declares a plan."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        inside = any(outer == "" or name == outer or name.startswith(f"{outer}.") for outer, _ in found)
        config = getattr(module, "config", None)
        declares = getattr(config, "base_model_tp_plan", None) or getattr(config, "base_model_ep_plan", None)
        if not inside and declares:
            found.append((name, module))
    return found


def _hf_plan(model: nn.Module) -> tuple[dict[str, str], str] | None:
    owners = _declaring(model)
    if not owners:
        return None
    plan: dict[str, str] = {}
    from_ep = False
    for path, owner in owners:
        config: Any = owner.config
        prefix = getattr(owner, "base_model_prefix", "")
        inner = prefix and isinstance(getattr(owner, prefix, None), nn.Module)
        base = ".".join(p for p in (path, prefix if inner else "") if p)
        patterns = {}
        for key, style in (config.base_model_tp_plan or {}).items():
            ours = HF_STYLES.get(style)
            if ours is None:
                raise ParatrainError(
                    f"tensor parallelism: {type(config).__name__}.base_model_tp_plan gives {key!r} the style "
                    f"{style!r}, which paratrain does not map (it maps {', '.join(sorted(HF_STYLES))}); pass "
                    "setup(tp_plan=...) with colwise/rowwise pairs for this model")
            patterns[f"{base}.{key}" if base else key] = ours
        declared = resolve(model, patterns, f"{type(config).__name__}.base_model_tp_plan", strict=False)
        experts = _ep_experts(model, getattr(config, "base_model_ep_plan", None) or {}, base, declared)
        plan.update(declared)
        plan.update(experts)
        from_ep = from_ep or bool(experts)
    where = type(owners[0][1]).__name__
    return plan, f"{where}'s config (base_model_tp_plan{', experts from base_model_ep_plan' if from_ep else ''})"


def _ep_experts(model: nn.Module, ep_plan: dict[str, str], base: str, declared: dict[str, str]) -> dict[str, str]:
    """The experts modules a Hugging Face `base_model_ep_plan` names (transformers 5.25 on; before, the tensor plan
    named them as `moe_tp_experts`), as `experts` entries with their weights' styles read from each module
    (`expert_styles`): what expert parallelism splits by expert, tensor parallelism splits inside every expert. The
    tensor plan's own entries come first; the ep plan's other entries place layers on the expert mesh, which
    tensor parallelism has no part in."""
    patterns = {f"{base}.{key}" if base else key: "experts" for key, style in ep_plan.items() if style == HF_EP_EXPERTS}
    found: dict[str, str] = {}
    for name in resolve(model, patterns, "base_model_ep_plan", strict=False):
        if any(n == name or n.startswith(f"{name}.") for n in declared):
            continue
        styles = expert_styles(model.get_submodule(name))
        if styles:
            found[name] = "experts"
            found.update({f"{name}.{p}": s for p, s in styles.items()})
    return found


def _structural_plan(model: nn.Module) -> dict[str, str]:
    """Colwise/rowwise pairs found by name among each module's direct Linear children (fused projections as
    `fused`), a head-indexed Embedding beside an attention's projections (T5's relative position bias), MLPs
    written as nn.Sequential(Linear, activation, Linear), and pairs split over two sibling modules (`_split_pair`)."""
    plan: dict[str, str] = {}
    for parent_name, parent in model.named_modules():
        children = {n: m for n, m in parent.named_children() if _is_linear(m)}
        prefix = f"{parent_name}." if parent_name else ""
        qkv = [n for n in children if _QKV.match(n)]
        fused = [n for n in children if _FUSED_QKV.match(n)]
        out = [n for n in children if _OUT.match(n)]
        if (len(qkv) >= 3 or fused) and len(out) == 1:
            plan.update({f"{prefix}{n}": "colwise" for n in qkv})
            plan.update({f"{prefix}{n}": FUSED for n in fused})
            plan[f"{prefix}{out[0]}"] = "rowwise"
            plan.update({f"{prefix}{n}": "colwise" for n, m in parent.named_children()
                         if isinstance(m, nn.Embedding) and _heads_of(parent) == m.embedding_dim})
            continue
        up = [n for n in children if _UP.match(n)]
        fused_up = [n for n in children if _FUSED_UP.match(n)]
        down = [n for n in children if _DOWN.match(n) and n not in up]
        if (up or fused_up) and len(down) == 1:
            plan.update({f"{prefix}{n}": "colwise" for n in up})
            plan.update({f"{prefix}{n}": FUSED for n in fused_up})
            plan[f"{prefix}{down[0]}"] = "rowwise"
            continue
        if isinstance(parent, nn.Sequential):
            plan.update(_sequential_mlp(parent, prefix))
        plan.update(_split_pair(parent, prefix))
    return plan


def _split_pair(parent: nn.Module, prefix: str) -> dict[str, str]:
    """BERT's layout (RoBERTa, DeBERTa-v2, ELECTRA, Hugging Face ViT alike): each half of a pair sits in its
    own child module, so no module holds both. An attention's `self.query/key/value` (DeBERTa-v2's `query_proj`...)
    feed `output.dense`, the sibling after it; an MLP's `intermediate.dense` (followed only by its activation)
    feeds `output.dense`, which maps the intermediate width back. The first half is colwise, the second rowwise:
    the split activations pass from one module to the next as they would inside one."""
    if isinstance(parent, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return {}  # a container's items are repeated blocks, not the halves of one
    holders = [(name, child, {n: m for n, m in child.named_children() if _is_linear(m)})
               for name, child in parent.named_children() if not _is_linear(child)]
    holders = [h for h in holders if h[2]]
    plan: dict[str, str] = {}
    for (first, module, ins), (second, _, outs) in zip(holders, holders[1:]):
        if len(outs) != 1:
            continue
        (down_name, down), = outs.items()
        if not (_OUT.match(down_name) or _DOWN.match(down_name)):
            continue
        qkv = [n for n in ins if _QKV.match(n)]
        if len(qkv) >= 3 and not any(_OUT.match(n) or _FUSED_QKV.match(n) for n in ins):
            if in_features(down) in {out_features(ins[n]) for n in qkv}:
                plan.update({f"{prefix}{first}.{n}": "colwise" for n in qkv})
                plan[f"{prefix}{second}.{down_name}"] = "rowwise"
            continue
        if len(ins) != 1:
            continue
        (up_name, up), = ins.items()
        others = [m for n, m in module.named_children() if n != up_name]
        if ((_UP.match(up_name) or _OUT.match(up_name)) and not any(True for m in others for _ in m.parameters())
                and in_features(down) == out_features(up) and out_features(down) == in_features(up)):
            plan[f"{prefix}{first}.{up_name}"] = "colwise"
            plan[f"{prefix}{second}.{down_name}"] = "rowwise"
    return plan


def _heads_of(module: nn.Module) -> int | None:
    for name in ("n_heads", "num_heads", "num_attention_heads", "heads", "n_head"):
        value = getattr(module, name, None)
        if type(value) is int:
            return value
    return None


def _sequential_mlp(seq: nn.Sequential, prefix: str) -> dict[str, str]:
    """Linear, any parameter-free elementwise layers (activation, dropout), Linear."""
    items = list(seq.named_children())
    for i, (name, first) in enumerate(items):
        if not _is_linear(first):
            continue
        for later_name, later in items[i + 1:]:
            if _is_linear(later):
                return {f"{prefix}{name}": "colwise", f"{prefix}{later_name}": "rowwise"}
            if any(True for _ in later.parameters()):
                break
    return {}


def _listing(model: nn.Module) -> str:
    """The model's Linear layers in its own paths, folded over repeated blocks (`layers.*.fc`), and a plan to start
    from written in those paths."""
    folded: dict[str, nn.Module] = {}
    for name, module in _linears(model).items():
        folded.setdefault(re.sub(r"(?<=\.)\d+(?=\.)", "*", name), module)
    names = list(folded)
    if not names:
        return "its Linear layers: none (tensor parallelism shards Linear layers); use a data-parallel layout"
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    example = ", ".join(f"{n!r}: {s!r}" for n, s in _example_pair(folded).items())
    return (f"its Linear layers: {shown}; name the pairs yourself, a colwise layer feeding a rowwise one, e.g. "
            f"setup(tp_plan={{{example}}})")


def _example_pair(folded: dict[str, nn.Module]) -> dict[str, str]:
    """Two consecutive layers whose widths chain (the first's output features are the second's input), those of a
    repeated block first; a lone layer split with its output gathered again."""
    items = list(folded.items())
    chained = [(a, b) for (a, first), (b, second) in zip(items, items[1:])
               if out_features(first) == in_features(second)]
    repeated = [(a, b) for a, b in chained if "*" in a and "*" in b]
    if repeated or chained:
        a, b = (repeated or chained)[0]
        return {a: "colwise", b: "rowwise"}
    if len(items) == 1:
        return {items[0][0]: "colwise_gather_output"}
    return {items[0][0]: "colwise", items[1][0]: "rowwise"}


def find_plan(model: nn.Module, user: dict[str, str] | None) -> tuple[dict[str, str], str]:
    """(module name -> style, where the plan came from)."""
    if user:
        return resolve(model, {k: HF_STYLES.get(v, v) for k, v in user.items()}, "tp_plan"), "tp_plan"
    declared = _hf_plan(model)
    if declared and declared[0]:
        return declared
    plan = _structural_plan(model)
    if not plan:
        raise ParatrainError(f"tensor parallelism found no attention or MLP blocks in {type(model).__name__} "
                             f"to shard; {_listing(model)}")
    return plan, "the model's structure"


def without_ties(model: nn.Module, plan: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """The plan less the layers whose weight another layer outside the plan shares (a vocabulary-split embedding
    tied to the LM head): sharding one side would cut the tie. They stay whole, which is exact; and the reasons."""
    users: dict[int, set[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for param in module._parameters.values():
            if param is not None:
                users.setdefault(id(param), set()).add(path)
    kept, notes = dict(plan), []
    for name, style in plan.items():
        if is_parameter(model, name) or style == "partial_grad":
            continue
        module = model.get_submodule(name)
        others = {u for p in module._parameters.values() if p is not None for u in users[id(p)]} - set(plan)
        if others:
            del kept[name]
            notes.append(f"{name} stays whole: its weight is tied to {sorted(others)[0]}")
    return kept, notes


def is_parameter(model: nn.Module, name: str) -> bool:
    """Whether a plan entry names a parameter (an expert weight, a per-head sink) rather than a module."""
    owner, _, attr = name.rpartition(".")
    try:
        return attr in model.get_submodule(owner)._parameters
    except AttributeError:
        return False


def owner_of(plan: dict[str, str], name: str) -> str | None:
    """The experts module an expert-parameter entry belongs to (None: `name` is a module entry)."""
    parent = name.rpartition(".")[0]
    return parent if plan.get(parent) == "experts" else None


def check_plan(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Every sharded dimension divides by the degree, and so do the heads; no BatchNorm in the model."""
    bn = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if bn:
        raise ParatrainError(f"tensor parallelism with BatchNorm ({', '.join(bn[:4])}) is not supported: its "
                             "statistics would need the sharded features of every rank; use a data-parallel "
                             "strategy for this model")
    for name, style in plan.items():
        if owner_of(plan, name) is not None:
            continue
        if is_parameter(model, name):
            param = model.get_parameter(name)
            size = param.shape[0 if style == "colwise" else -1]
            if size % tp:
                raise ParatrainError(f"tensor parallelism: {name} ({style}) has {size} entries to split, which {tp} "
                                     f"tensor ranks cannot split evenly; use a tp_size that divides {size}")
            continue
        module = model.get_submodule(name)
        if style == "experts":
            _check_experts(model, plan, name, module, tp)
            continue
        if style == "partial_grad":
            continue
        if not (_is_linear(module) or isinstance(module, nn.Embedding)):
            raise ParatrainError(
                f"tensor parallelism: {name} is a {type(module).__name__}, not an nn.Linear; torch shards "
                "nn.Linear and nn.Embedding (and paratrain Hugging Face's Conv1D and expert weights): leave it out "
                "of tp_plan")
        split_out = style in ("colwise", "colwise_gather_output", "packed_colwise", FUSED)
        dim, what = (out_features(module), "output features") if split_out else (in_features(module), "input features")
        if dim % tp:
            raise ParatrainError(f"tensor parallelism: {name} ({style}) has {dim} {what}, which {tp} tensor ranks "
                                 f"cannot split evenly; use a tp_size that divides {dim}")
    _check_heads(model, plan, tp)


def _check_experts(model: nn.Module, plan: dict[str, str], name: str, module: nn.Module, tp: int) -> None:
    from .styles import experts_placements

    declared = {n.rpartition(".")[2]: s for n, s in plan.items() if owner_of(plan, n) == name}
    for pname, placement in experts_placements(module, declared, name).items():
        dim = placement.dim if hasattr(placement, "dim") else 1
        size = module.get_parameter(pname).shape[dim]
        if size % (tp * getattr(placement, "split_factor", 1)):
            raise ParatrainError(f"tensor parallelism: {name}.{pname} has {size} features on dimension {dim}, which "
                                 f"{tp} tensor ranks cannot split evenly; use a tp_size that divides "
                                 f"{size // getattr(placement, 'split_factor', 1)}")


_HEAD_COUNTS = (("num_attention_heads", "attention heads"), ("num_key_value_heads", "key/value heads"))


def _check_heads(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Heads are what the ranks divide: a model whose attention (or key/value) heads the degree does not divide
    is refused with the degrees that would work, rather than failing inside a reshape."""
    sharded = {name.rpartition(".")[0] for name, style in plan.items() if style != "experts"}
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        if config is None or not any(p == path or p.startswith(f"{path}.") or not path for p in sharded):
            continue
        for attr, what in _HEAD_COUNTS:
            count = getattr(config, attr, None)
            if type(count) is int and count % tp:
                ways = [d for d in range(1, count + 1) if count % d == 0]
                raise ParatrainError(
                    f"tensor parallelism: {type(module).__name__} has {count} {what} "
                    f"({type(config).__name__}.{attr}), which {tp} tensor ranks cannot split evenly: each rank "
                    f"computes whole heads; use tp_size in {ways}")
        return


def describe(plan: dict[str, str], source: str, tp: int) -> str:
    """The plan in the user's names, folded over repeated blocks (blocks.0, blocks.1 -> blocks.*)."""
    folded: dict[str, str] = {}
    for name, style in plan.items():
        folded[re.sub(r"\.\d+\.", ".*.", name)] = style
    parts = ", ".join(f"{k} {v}" for k, v in folded.items())
    return f"tensor parallel over {tp} ranks, plan from {source}: {parts}"
