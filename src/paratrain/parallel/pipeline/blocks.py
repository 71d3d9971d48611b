"""Pipeline stages made of a Hugging Face decoder's own modules, called as themselves: no tracing.

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
        fix = ("drop 'cp' or 'pp' from the strategy (context parallelism inside a pipeline needs the positions a "
               "transformers decoder passes across its cuts)" if share is not None else
               "write the model as an nn.Sequential of its blocks (embedding, blocks, head: each stage then calls "
               "them as themselves), or drop 'ep' or 'pp' from the strategy")
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
