"""Which Linear layers tensor parallelism shards, and how: "colwise" (output features split over the tensor
ranks) or "rowwise" (input features split; the outputs are summed), Megatron's pairs.

Plans come, first match wins, from the user (`tp_plan={"blocks.*.attn.q": "colwise", ...}`), from the model's
own declaration (Hugging Face configs carry `base_model_tp_plan`), or from the structure of the usual blocks:
separate q/k/v projections and their output projection, MLP up/gate and down. Whatever the source, the plan is
resolved to the user's module names here, so it can be printed, checked and refused by name.
"""

from __future__ import annotations

import fnmatch
import re

from torch import nn

from ...errors import ParatrainError

STYLES = ("colwise", "rowwise")

_QKV = re.compile(r"^(q|k|v|wq|wk|wv|q_proj|k_proj|v_proj|query|key|value|q_lin|k_lin|v_lin)$")
_OUT = re.compile(r"^(o|wo|o_proj|out_proj|proj|c_proj|dense|out_lin)$")
_UP = re.compile(r"^(w1|w3|up|gate|up_proj|gate_proj|fc1|c_fc|fc_in|lin1|dense_h_to_4h)$")
_DOWN = re.compile(r"^(w2|down|down_proj|fc2|c_proj|fc_out|lin2|dense_4h_to_h)$")
_FUSED = re.compile(r"^(qkv|c_attn|wqkv|Wqkv|query_key_value|in_proj|qkv_proj|gate_up_proj)$")


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if _is_linear(m)}


def _is_linear(module: nn.Module) -> bool:
    """nn.Linear, or Hugging Face's GPT-2 Conv1D (a Linear with its weight transposed): the latter is refused."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def resolve(model: nn.Module, patterns: dict[str, str], source: str) -> dict[str, str]:
    """Module name -> style for every module a pattern names (`*` matches one name, as in torch's plans)."""
    plan: dict[str, str] = {}
    names = [n for n, _ in model.named_modules() if n]
    for pattern, style in patterns.items():
        if style not in STYLES:
            raise ParatrainError(f"tensor parallelism: {source} gives {pattern!r} the style {style!r}; paratrain "
                                 f"shards with {' or '.join(STYLES)} (leave other modules out of the plan)")
        atoms = pattern.split(".")
        hits = [n for n in names if len(n.split(".")) == len(atoms)
                and all(fnmatch.fnmatchcase(a, p) for a, p in zip(n.split("."), atoms, strict=True))]
        if not hits:
            raise ParatrainError(f"tensor parallelism: {source} names {pattern!r}, which matches no module of "
                                 f"{type(model).__name__}; {_listing(model)}")
        for name in hits:
            plan[name] = style
    return plan


def _hf_plan(model: nn.Module) -> dict[str, str] | None:
    config = getattr(model, "config", None)
    declared = getattr(config, "base_model_tp_plan", None)
    if not declared:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    inner = prefix and isinstance(getattr(model, prefix, None), nn.Module)
    # Entries in other styles (sequence parallelism, gathers) are left replicated, which stays exact.
    patterns = {(f"{prefix}.{k}" if inner else k): v for k, v in declared.items() if v in STYLES}
    return resolve(model, patterns, f"{type(config).__name__}.base_model_tp_plan")


def _structural_plan(model: nn.Module) -> dict[str, str]:
    """Colwise/rowwise pairs found by name among each module's direct Linear children, and MLPs written as
    nn.Sequential(Linear, activation, Linear)."""
    plan: dict[str, str] = {}
    for parent_name, parent in model.named_modules():
        children = {n: m for n, m in parent.named_children() if _is_linear(m)}
        prefix = f"{parent_name}." if parent_name else ""
        fused = [n for n in children if _FUSED.match(n)]
        if fused:
            raise ParatrainError(
                f"tensor parallelism: {prefix}{fused[0]} is a fused projection (q, k and v, or gate and up, in one "
                "Linear); one colwise split would give the first rank all of q and part of k, and a forward that "
                "splits the output by the model width would mix them. Split it into separate Linears, or give "
                f"tp_plan= for the other layers and leave it replicated. {_listing(model)}")
        qkv = [n for n in children if _QKV.match(n)]
        out = [n for n in children if _OUT.match(n)]
        if len(qkv) >= 3 and len(out) == 1:
            plan.update({f"{prefix}{n}": "colwise" for n in qkv})
            plan[f"{prefix}{out[0]}"] = "rowwise"
            continue
        up = [n for n in children if _UP.match(n)]
        down = [n for n in children if _DOWN.match(n)]
        if up and len(down) == 1:
            plan.update({f"{prefix}{n}": "colwise" for n in up})
            plan[f"{prefix}{down[0]}"] = "rowwise"
            continue
        if isinstance(parent, nn.Sequential):
            plan.update(_sequential_mlp(parent, prefix))
    return plan


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
    names = list(_linears(model))
    shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
    return (f"its Linear layers: {shown or 'none'}; name the pairs yourself, e.g. "
            "setup(tp_plan={'blocks.*.attn.q': 'colwise', 'blocks.*.attn.out': 'rowwise'})")


def find_plan(model: nn.Module, user: dict[str, str] | None) -> tuple[dict[str, str], str]:
    """(module name -> style, where the plan came from)."""
    if user:
        return resolve(model, user, "tp_plan"), "tp_plan"
    declared = _hf_plan(model)
    if declared:
        return declared, f"{type(model).__name__}'s config (base_model_tp_plan)"
    plan = _structural_plan(model)
    if not plan:
        raise ParatrainError(f"tensor parallelism found no attention or MLP blocks in {type(model).__name__} "
                             f"to shard; {_listing(model)}")
    return plan, "the model's structure"


def check_plan(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Every sharded dimension divides by the degree; the layers are Linears; no BatchNorm in the model."""
    bn = [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if bn:
        raise ParatrainError(f"tensor parallelism with BatchNorm ({', '.join(bn[:4])}) is not supported: its "
                             "statistics would need the sharded features of every rank; use a data-parallel "
                             "strategy for this model")
    for name, style in plan.items():
        module = model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise ParatrainError(
                f"tensor parallelism: {name} is a {type(module).__name__}, not an nn.Linear; torch shards "
                "nn.Linear and nn.Embedding (Hugging Face's GPT-2 Conv1D stores its weight transposed): leave it "
                "out of tp_plan, or use a model built from nn.Linear")
        dim, what = ((module.out_features, "output features") if style == "colwise"
                     else (module.in_features, "input features"))
        if dim % tp:
            raise ParatrainError(f"tensor parallelism: {name} ({style}) has {dim} {what}, which {tp} tensor ranks "
                                 f"cannot split evenly; use a tp_size that divides {dim}")


def describe(plan: dict[str, str], source: str, tp: int) -> str:
    """The plan in the user's names, folded over repeated blocks (blocks.0, blocks.1 -> blocks.*)."""
    folded: dict[str, str] = {}
    for name, style in plan.items():
        folded[re.sub(r"\.\d+\.", ".*.", name)] = style
    parts = ", ".join(f"{k} {v}" for k, v in folded.items())
    return f"tensor parallel over {tp} ranks, plan from {source}: {parts}"
