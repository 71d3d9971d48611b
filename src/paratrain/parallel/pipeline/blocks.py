"""Pipeline stages made of a model's own modules, called as themselves: no tracing (a Hugging Face decoder's
blocks, or under `cp` a user nn.Sequential's children, `sequential_layers`).

A traced stage computes aten ops with every shape the trace saw written in, so what other axes put inside a block
at run time cannot live there: the expert dispatch (`ep`: tokens travel to the rank holding their expert) and the
attention over the whole sequence (`cp`: keys and values gathered over the group). A decoder-only causal LM as
transformers builds it (`model.embed_tokens`, `model.layers`, `model.rotary_emb`, `model.norm`, `lm_head`) is a
chain of its own blocks, which torchtitan's models are by construction; so its stages are

    entry (embed_tokens)  ->  one layer per decoder block  ->  exit (norm, lm_head)

each a thin holder that calls the user's modules, with the hidden states and the positions crossing every cut.
Each block builds its attention mask as the model's forward does (`create_causal_mask` or the sliding-window one
per layer type, with the cache the model would build), so a stage computes what the same layers compute in the
unsplit model. Under `cp` the entry cuts each row to this rank's share, every block attends over the group
(`context.Share`), and the exit gathers the logits back into whole rows for the loss.

A user nn.Sequential's children are such a chain already: expert parallelism lives in them as they are; under `cp`
each is held the same way, the first cutting the rows, the global positions crossing the cuts to every child whose
forward takes `position_ids`, the last gathering the outputs.

The holders register the modules under their paths in the model (`model.layers.3`), as traced segments do, so
checkpoints, exports and plans see the model's own names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ...errors import ParatrainError

if TYPE_CHECKING:
    from ..context import Share

_TAKEN = ("input_ids", "position_ids")


class PathHolder(nn.Module):
    """A chain layer holding the user's modules under their dotted paths (registered by `partition._register`)."""

    holds_paths = True

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        for path, module in modules.items():
            node: nn.Module = self
            *parents, name = path.split(".")
            for part in parents:
                if part not in node._modules:
                    node.add_module(part, nn.Module())
                node = node._modules[part]  # type: ignore[assignment]
            node.add_module(name, module)


def decoder_parts(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(prefix, base model) of a transformers decoder-only causal LM built the usual way, else None."""
    if not any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        return None
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    if not isinstance(base, nn.Module) or not isinstance(getattr(model, "lm_head", None), nn.Module):
        return None
    if not all(isinstance(getattr(base, name, None), nn.Module)
               for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None
    return (prefix, base) if isinstance(base.layers, nn.ModuleList) else None


def decoder_layers(model: nn.Module, share: Share | None) -> list[tuple[str, nn.Module]]:
    """The chain of a decoder's stages-to-be (see the module docstring), or a refusal naming why not."""
    found = decoder_parts(model)
    if found is None:
        fix = ("write the model as an nn.Sequential of its blocks (embedding, blocks, head: each stage then calls "
               "them as themselves, the positions passed to those that take position_ids), or drop "
               f"'{'cp' if share is not None else 'ep'}' or 'pp' from the strategy")
        raise ParatrainError(
            f"pipeline stages that hold expert or context parallelism are made of the model's own blocks, and "
            f"{type(model).__name__} is not a decoder-only causal LM as transformers builds it (model.embed_tokens, "
            "model.layers, model.rotary_emb, model.norm, lm_head), so it would be traced, and a traced stage cannot "
            f"run an expert dispatch or attention over the sequence's shares; {fix}")
    prefix, base = found
    config = model.config
    layers = cast(nn.ModuleList, base.layers)
    if getattr(config, "output_router_logits", False):
        raise ParatrainError(
            f"{type(model).__name__} with output_router_logits=True under a pipeline: its load-balancing loss is "
            "taken over each micro-batch's router logits, not the batch's; set config.output_router_logits = False "
            "or drop 'pp'")
    chain: list[tuple[str, nn.Module]] = [("entry", _Entry(prefix, base, share))]
    for i, layer in enumerate(layers):
        chain.append((f"{prefix}.layers.{i}", _Block(prefix, base, i, layer, share)))
    chain.append(("exit", _Exit(prefix, base, cast(nn.Module, model.lm_head), share)))
    return chain


def sequential_layers(model: nn.Sequential, share: Share) -> list[tuple[str, nn.Module]]:
    """A user nn.Sequential's children as the stages-to-be of context parallelism inside a pipeline: the first cuts
    each row to this rank's share, every child attends over the group, the last gathers its outputs into whole rows;
    the global positions cross every cut and go to each child whose forward takes `position_ids` (its rotary or
    absolute embeddings number the share's tokens by them), or a refusal where no child takes them."""
    from ..context import gives_positions

    children = list(model.named_children())
    if not gives_positions(model):
        names = ", ".join(name for name, _ in children)
        raise ParatrainError(
            f"context parallelism inside a pipeline: no child of the nn.Sequential ({names}) takes position_ids, "
            "so its position embeddings would number each rank's share of the sequence from 0; "
            "give the blocks that use positions a `position_ids=None` argument (positions 0..length-1 when it is "
            "absent, as in one process), or drop 'cp' or 'pp' from the strategy")
    last = len(children) - 1
    return [(name, _Child(name, child, share, i == 0, i == last)) for i, (name, child) in enumerate(children)]


class _Child(PathHolder):
    _child: nn.Module
    _share: Share
    _first: bool
    _last: bool
    _positions: bool

    def __init__(self, name: str, child: nn.Module, share: Share, first: bool, last: bool) -> None:
        from ..context import takes_positions

        super().__init__({name: child})
        self.__dict__.update(_child=child, _share=share, _first=first, _last=last, _positions=takes_positions(child))

    def forward(self, value: Any) -> Any:
        share = self._share
        if self._first:
            if not isinstance(value, torch.Tensor):
                raise ParatrainError(f"a pipeline of an nn.Sequential's children under context parallelism takes one "
                                     f"tensor of token ids, not {type(value).__name__}")
            length = value.shape[1]
            positions = torch.arange(length, device=value.device)[None].expand(value.shape[0], -1)
            value, positions = share.cut((value, positions), length)
            positions = positions.contiguous()
        else:
            value, positions = value
        whole = positions.shape[1] * share.size
        with share.attending(whole):
            out = self._child(value, position_ids=positions) if self._positions else self._child(value)
        return share.whole(out, whole) if self._last else (out, positions)


def _part(base: nn.Module, name: str) -> nn.Module:
    return cast(nn.Module, getattr(base, name))


class _Entry(PathHolder):
    _embed: nn.Module
    _share: Share | None

    def __init__(self, prefix: str, base: nn.Module, share: Share | None) -> None:
        super().__init__({f"{prefix}.embed_tokens": _part(base, "embed_tokens")})
        self.__dict__.update(_embed=_part(base, "embed_tokens"), _share=share)  # unregistered: held above, by path

    def forward(self, inputs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ids, positions = _ids_and_positions(inputs)
        length = ids.shape[1]
        if positions is None:
            positions = torch.arange(length, device=ids.device)[None].expand(ids.shape[0], -1)
        share = self._share
        if share is not None:
            ids, positions = share.cut((ids, positions.expand(ids.shape[0], -1)), length)
        return self._embed(ids), positions.expand(ids.shape[0], -1).contiguous()


class _Block(PathHolder):
    _layer: nn.Module
    _rotary: nn.Module
    _config: Any
    _index: int
    _share: Share | None

    def __init__(self, prefix: str, base: nn.Module, index: int, layer: nn.Module, share: Share | None) -> None:
        rotary = _part(base, "rotary_emb")
        super().__init__({f"{prefix}.layers.{index}": layer, f"{prefix}.rotary_emb": rotary})
        self.__dict__.update(_layer=layer, _rotary=rotary, _config=base.config, _index=index, _share=share)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, positions = value
        share = self._share
        local = hidden.shape[1]
        # under cp the share's positions jump from its head chunk to its tail one: a padding mask of ones keeps
        # transformers from reading that as a second packed document (as `context.apply_cp` does)
        padding = torch.ones(hidden.shape[0], local, dtype=torch.long, device=hidden.device) if share else None
        mask = _mask(self._config, self._index, hidden, padding, positions)
        embeddings = self._rotary(hidden, positions)
        attending = share.attending(local * share.size) if share is not None else contextlib.nullcontext()
        with attending:
            out = self._layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=embeddings,
                              use_cache=False)
        return (out[0] if isinstance(out, tuple) else out), positions


class _Exit(PathHolder):
    _norm: nn.Module
    _head: nn.Module
    _share: Share | None

    def __init__(self, prefix: str, base: nn.Module, head: nn.Module, share: Share | None) -> None:
        super().__init__({f"{prefix}.norm": _part(base, "norm"), "lm_head": head})
        self.__dict__.update(_norm=_part(base, "norm"), _head=head, _share=share)

    def forward(self, value: tuple[torch.Tensor, torch.Tensor]) -> Any:
        from transformers.modeling_outputs import CausalLMOutputWithPast

        hidden, _ = value
        logits = self._head(self._norm(hidden))
        share = self._share
        if share is not None:
            logits = share.whole(logits, hidden.shape[1] * share.size)
        return CausalLMOutputWithPast(logits=logits)


def _ids_and_positions(inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(inputs, torch.Tensor):
        return inputs, None
    if isinstance(inputs, Mapping) and isinstance(inputs.get("input_ids"), torch.Tensor):
        other = [k for k, v in inputs.items() if k not in _TAKEN and v is not None]
        if other:
            raise ParatrainError(
                f"a pipeline of a decoder's own blocks takes input_ids and position_ids; the batch also brings "
                f"{other} (a padding mask: pack the sequences instead), which its stages would not apply; leave them "
                "out of the model's inputs")
        return inputs["input_ids"], inputs.get("position_ids")
    raise ParatrainError(f"a pipeline of a decoder's own blocks takes input_ids (a tensor, or a dict holding it), "
                         f"not {type(inputs).__name__}")


def _mask(config: Any, index: int, hidden: torch.Tensor, padding: torch.Tensor | None,
          positions: torch.Tensor) -> Any:
    """The attention mask the model's forward gives layer `index` (None where SDPA may take is_causal)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kinds = getattr(config, "layer_types", None)
    sliding = (kinds[index] == "sliding_attention" if kinds else getattr(config, "sliding_window", None) is not None
               and getattr(config, "use_sliding_window", True))
    build = create_sliding_window_causal_mask if sliding else create_causal_mask
    cache = None
    if getattr(config, "use_cache", False):  # the model builds one in a training forward, which changes the mask
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=config)
    return build(config=config, inputs_embeds=hidden, attention_mask=padding, cache=cache, position_ids=positions)
