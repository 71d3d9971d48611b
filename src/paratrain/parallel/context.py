"""Context parallelism: each rank of a `cp` group computes a share of every sequence, attention exact across them.

The model's forward is wrapped once (`apply_cp`). Inside it:

- inputs are cut along the sequence (dimension 1 of every input with the sequence's length), load-balanced for
  causal attention as torchtitan and Megatron do it: the sequence in 2 x cp chunks, rank i keeping chunks i and
  2cp-1-i, so every rank has as many early (cheap) as late (expensive) queries;

      cp 2, 8 tokens:   chunks 0 1 2 3   rank 0: tokens 0 1 + 6 7   rank 1: tokens 2 3 + 4 5

- the model is given the global positions of its tokens (`position_ids`, or the batch's own cut to the share:
  packed documents restart them), so rotary and absolute position embeddings see where each token is in the
  sequence, not in its share; a Hugging Face model given no `attention_mask` is given one of ones (no padding), which is
  what it would assume, since without it transformers (5.25 on, without a cache) reads the jump in a rank's
  positions from its head chunk to its tail chunk as the start of another packed document and masks across it,
  on that rank only;
- every `F.scaled_dot_product_attention` call attends from the rank's queries to the whole sequence's keys and
  values, gathered over the group in one differentiable all-gather (the backward returns each key's gradient to
  the rank that holds it) and left in rank order, causal by their global positions (the mask is built once per
  forward). This is exact attention, not an approximation, on any device;
  torch's own `context_parallel` has no rule for the CPU attention kernel;
- outputs with the share's length are gathered back into the whole sequence, in order, so the loss is the whole
  sequence's, computed by the user's code on every rank of the group (its gradient reaches each rank's share
  `cp` times over, which the data-parallel mean over the group then divides: the gradients one process gets).

A mask the model passes itself is taken as causal attention over the gathered keys when it is exactly the causal
mask of the share's positions (a model that builds its mask rather than leaving it to `is_causal`), and as causal
attention within each document when it is that mask within the documents of the share (`document_ids` the model
takes, masked with `data.document_mask`); any other mask (padding) is refused by name. A Hugging Face model reads
packed documents from restarting `position_ids` itself (without a cache or a padding mask); given the ones mask
above it would not, so its documents are applied here, over the whole row (`Documents`).

Attention paratrain cannot see (a softmax over scores computed by hand) would attend within each share only: it is
refused by name at the first forward, as is a forward with no `position_ids` argument.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .. import _forwards
from .._tree import map_tensors, tensors_in
from ..errors import ParatrainError

REASON = "context parallelism (parallel.context)"


def shares(length: int, size: int, rank: int) -> torch.Tensor:
    """The global positions rank `rank` of `size` holds of a sequence of `length`: chunks rank and 2*size-1-rank."""
    if length % (2 * size):
        raise ParatrainError(
            f"context parallelism over {size} ranks cuts each sequence into 2 x {size} = {2 * size} equal chunks "
            f"(load balance for causal attention), and sequences of {length} tokens do not divide: use a sequence "
            f"length that is a multiple of {2 * size}, or a cp_size that divides it")
    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


class _Gather:
    """The group's shares of a tensor along one dimension, back in sequence order (differentiable)."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size

    def __call__(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Rank r's share is its chunks r and 2*size-1-r (`shares`): the chunks are put back in order as whole
        slices (one copy, and slices in the backward), not token by token."""
        pieces = self.shares(t, dim).chunk(2 * self.size, dim)  # rank r's head at 2r, its tail at 2r+1
        heads = [pieces[2 * r] for r in range(self.size)]
        tails = [pieces[2 * r + 1] for r in reversed(range(self.size))]
        return torch.cat(heads + tails, dim)

    def shares(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """The group's shares of `t` along `dim`, rank after rank (not in sequence order)."""
        from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor

        moved = t.movedim(dim, 0).contiguous()
        return wait_tensor(all_gather_single_autograd(moved, 0, self.group)).movedim(0, dim)


def means_causal(mask: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether a model's own attention mask over its share (global `positions`) is exactly the causal mask of those
    positions, in every row of its batch and heads: boolean (True: attend) or additive (0: attend, the dtype's
    lowest or -inf: not), over (..., share, share). A mask cut where the positions jump (a packed-sequence
    detection's reading of the head and tail chunks) is not: it would attend less than the whole sequence does."""
    length = positions.shape[0]
    if mask.dim() < 2 or tuple(mask.shape[-2:]) != (length, length):
        return False
    positions = positions.to(mask.device)
    attends = _attends(mask)
    return attends is not None and bool((attends == (positions[None, :] <= positions[:, None])).all())


def _attends(mask: torch.Tensor) -> torch.Tensor | None:
    """A mask as booleans (True: attend): boolean, or additive (0: attend, the dtype's lowest or -inf: not); None
    for an additive bias, which is not a mask."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    attends = mask == 0
    return attends if bool((attends | (mask <= torch.finfo(mask.dtype).min)).all()) else None


class Documents:
    """The documents packed in each row of this forward's batch, as attention across the shares must see them.

    `ids` (batch, length) numbers each token's document over the whole row (None: one document per row);
    `applied` says that the attention calls mask them even where the model asks for causal attention, because the
    model, run in one process, would (a Hugging Face model reading them from its `position_ids`, which is given a
    padding mask of ones under `cp`, see `apply_cp`)."""

    def __init__(self, ids: torch.Tensor | None, applied: bool) -> None:
        self.ids, self.applied = ids, applied

    def share(self, mine: torch.Tensor) -> torch.Tensor | None:
        """Each query's document may attend to: the model's own mask over the share, where it masks documents."""
        if self.ids is None:
            return None
        docs = self.ids.index_select(1, mine.to(self.ids.device))
        causal = torch.ones(len(mine), len(mine), dtype=torch.bool, device=docs.device).tril()
        return (docs[:, :, None] == docs[:, None, :]) & causal

    def across(self, causal: torch.Tensor, mine: torch.Tensor, every: torch.Tensor) -> torch.Tensor:
        """(batch, 1, share, whole): causal by place and within each query's document, keys in rank order."""
        assert self.ids is not None
        ids = self.ids.to(causal.device)
        mine_docs, every_docs = ids.index_select(1, mine.to(ids.device)), ids.index_select(1, every.to(ids.device))
        return (causal[None] & (mine_docs[:, :, None] == every_docs[:, None, :]))[:, None]


def packed_documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document numbers of rows whose `position_ids` restart (a new document wherever a position is not the one
    before it plus one: transformers' reading), or None where every row is one document."""
    if position_ids.dim() != 2:
        return None
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    ids = (step != 1).cumsum(-1)
    return ids if bool((ids[:, -1] != 0).any()) else None


def _same_mask(mask: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether a boolean or additive mask means exactly `want` (True: attend), broadcast over batch and heads."""
    attends = _attends(mask)
    if attends is None:
        return False
    while want.dim() < attends.dim():
        want = want.unsqueeze(1)  # (batch, share, share) against (batch, heads, share, share)
    try:
        return bool((attends == want.to(attends.device)).all())
    except RuntimeError:  # shapes that do not broadcast: another batch
        return False


def _sdpa(original: Callable[..., Any], gather: _Gather, positions: torch.Tensor,
          gathered: torch.Tensor, documents: Documents) -> Callable[..., Any]:
    """Attention from this rank's queries (global `positions`) to every rank's keys and values, gathered in one
    collective in rank order (their global positions: `gathered`); the mask follows the positions (and the
    documents), so the keys need no reordering, and it is built once per forward. A mask the model passes is read
    once per forward: the causal mask of the share's positions (`means_causal`), or that mask within the share's
    documents (`Documents.share`), and is replaced by the same rule over the whole sequence."""
    masks: dict[tuple[torch.device, bool], torch.Tensor] = {}
    read: list[tuple[torch.Tensor, str | None]] = []  # the model's masks met in this forward: usually every layer's
    own_documents = documents.share(positions)

    def kind(mask: torch.Tensor) -> str | None:
        for known, verdict in read:
            if known is mask:
                return verdict
        verdict = ("causal" if means_causal(mask, positions) else
                   "documents" if own_documents is not None and _same_mask(mask, own_documents) else None)
        read.append((mask, verdict))
        return verdict

    def whole_mask(device: torch.device, by_documents: bool) -> torch.Tensor:
        if (device, by_documents) not in masks:
            causal = gathered.to(device)[None, :] <= positions.to(device)[:, None]
            masks[device, by_documents] = documents.across(causal, positions, gathered) if by_documents else causal
        return masks[device, by_documents]

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: Any = None, **kwargs: Any) -> torch.Tensor:
        by_documents = False
        if attn_mask is not None:
            verdict = kind(attn_mask) if isinstance(attn_mask, torch.Tensor) and not is_causal else None
            if verdict is None:
                raise ParatrainError(
                    "context parallelism: an attention call passes its own mask, which is neither the causal mask of "
                    "the share's positions nor that mask within the documents of the batch's `document_ids` "
                    "(padding, or documents read another way), so paratrain cannot rewrite it for the whole "
                    "sequence; pack sequences instead of padding them, give the model `document_ids` and mask "
                    "with paratrain.data.document_mask(document_ids), pass a Hugging Face model inside yours "
                    "attention_mask (ones), or drop 'cp' from the strategy")
            attn_mask, is_causal, by_documents = None, True, verdict == "documents"
        if dropout_p:
            raise ParatrainError("context parallelism: attention dropout would draw its mask per share, not as one "
                                 "process draws it; set the attention dropout to 0 or drop 'cp'")
        if key.shape == value.shape:  # one collective for both
            keys, values = gather.shares(torch.stack([key, value]), -2).unbind(0)
        else:
            keys, values = gather.shares(key, -2), gather.shares(value, -2)
        mask = None
        if is_causal:
            mask = whole_mask(query.device, by_documents or (documents.applied and documents.ids is not None))
        return original(query, keys, values, attn_mask=mask, dropout_p=0.0, is_causal=False, scale=scale, **kwargs)

    return attention


class _HandWrittenAttention(TorchFunctionMode):
    """Refuses a softmax over a square of the share's length: attention scores computed without SDPA."""

    def __init__(self, local: int) -> None:
        super().__init__()
        self.local = local

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.softmax, F.softmax, torch.Tensor.softmax) and args:
            t = args[0]
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == t.shape[-2] == self.local:
                raise ParatrainError(
                    "context parallelism: the model computes attention by hand (a softmax over a "
                    f"{self.local} x {self.local} score matrix), which would attend within each rank's share of the "
                    "sequence only; use F.scaled_dot_product_attention (Hugging Face: attn_implementation='sdpa' or "
                    "'eager' -> 'sdpa'), or drop 'cp' from the strategy")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _attending(gather: _Gather, positions: torch.Tensor, gathered: torch.Tensor, documents: Documents, local: int,
               first: bool) -> Iterator[None]:
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _sdpa(original, gather, positions, gathered, documents)  # type: ignore[assignment]
    watch = _HandWrittenAttention(local) if first else contextlib.nullcontext()
    try:
        with watch:
            yield
    finally:
        F.scaled_dot_product_attention = original  # type: ignore[assignment]


class Share:
    """One rank's share of every sequence: which places it holds, the attention over the group while a forward runs,
    and the gather of outputs back into whole sequences. `apply_cp` uses it around a whole model; a pipeline's
    block stages (`pipeline.blocks`) cut at the first stage, attend in every block and gather at the last."""

    def __init__(self, group: Any, size: int, rank: int) -> None:
        self.size, self.rank = size, rank
        self.gather = _Gather(group, size)
        self._layouts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._calls = 0
        self.own_tokens = False
        """Set while a micro-step takes each rank's loss over its own tokens (`token_mean`): outputs stay shares."""

    def layout(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's places in a sequence of `length`, and the group's places rank after rank (as a gather
        returns them): integers fixed by the length, made once per length."""
        if length not in self._layouts:
            self._layouts[length] = (shares(length, self.size, self.rank),
                                     torch.cat([shares(length, self.size, r) for r in range(self.size)]))
        return self._layouts[length]

    def cut(self, value: Any, length: int) -> Any:
        """Every tensor of `value` with a sequence of `length` (dim 1), cut to this rank's places."""
        mine = self.layout(length)[0]
        return map_tensors(lambda t: t.index_select(1, mine.to(t.device))
                           if t.dim() >= 2 and t.shape[1] == length else t, value)

    def whole(self, value: Any, length: int) -> Any:
        """Every tensor of `value` with this rank's share of a sequence of `length`, gathered into the whole."""
        local = len(self.layout(length)[0])
        return map_tensors(lambda t: self.gather(t, 1) if t.dim() >= 2 and t.shape[1] == local else t, value)

    def attending(self, length: int, documents: Documents | None = None) -> contextlib.AbstractContextManager[None]:
        """Attention calls from this rank's queries to the whole sequence while the context is open."""
        mine, every = self.layout(length)
        self._calls += 1
        return _attending(self.gather, mine, every, documents or Documents(None, False), len(mine), self._calls == 1)


def apply_cp(model: nn.Module, group: Any, size: int, rank: int) -> nn.Module:
    """Make `model`'s forward run on this rank's share of each sequence (see the module docstring)."""
    if not gives_positions(model):
        raise ParatrainError(
            f"context parallelism: {type(model).__name__}.forward takes no position_ids, so its position embeddings "
            "would number each rank's share of the sequence from 0; add a `position_ids=None` argument that, when "
            "given, sets the positions its rotary or absolute embeddings use (Hugging Face models have one; in an "
            "nn.Sequential, to the blocks that use positions), or drop 'cp' from the strategy")
    inner = model.forward if takes_positions(model) else _with_positions(cast(nn.Sequential, model))
    unmasked = _no_padding_mask(model)
    share = Share(group, size, rank)

    def forward(*args: Any, **kwargs: Any) -> Any:
        found = [t for t in tensors_in((args, kwargs)) if t.dim() >= 2]
        if not found:
            raise ParatrainError("context parallelism: the model's inputs hold no tensor with a sequence dimension "
                                 "(batch, sequence, ...) to share out")
        length = found[0].shape[1]
        mine = share.layout(length)[0]
        padded = unmasked is not None and _passes_mask(unmasked, args, kwargs)  # the caller gave a padding mask
        documents = _documents(model, unmasked is not None and not padded, length, args, kwargs)
        args, kwargs = share.cut((args, kwargs), length)
        batch, device = found[0].shape[0], found[0].device
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = mine.to(device)[None, :].expand(batch, -1)
        if unmasked is not None and not padded:
            kwargs["attention_mask"] = torch.ones(batch, len(mine), dtype=torch.long, device=device)
        with share.attending(length, documents):
            out = inner(*args, **kwargs)
        return out if share.own_tokens else share.whole(out, length)

    _forwards.replace(model, forward, REASON)
    model.__dict__[_SHARE] = share
    return model


_SHARE = "_paratrain_share"


def _counted(targets: torch.Tensor) -> int:
    """Tokens a token mean counts: every element of float targets, integer ones but `IGNORED`."""
    return targets.numel() if targets.is_floating_point() else int((targets != IGNORED).sum())


def share_of(model: nn.Module) -> Share | None:
    """The `Share` of a model `apply_cp` wrapped (None for others)."""
    found = model.__dict__.get(_SHARE)
    return found if isinstance(found, Share) else None


IGNORED = -100
"""The target that a token mean leaves out (`F.cross_entropy`'s default `ignore_index`)."""


@contextlib.contextmanager
def own_tokens(share: Share, loss_fn: Callable[[Any, Any], torch.Tensor]) -> Iterator[Callable[[Any, Any], Any]]:
    """While open, the model's outputs stay this rank's share, and the returned loss function takes the loss of the
    share's tokens: `loss_fn` on the share's outputs and targets, times cp x (the share's counted tokens / the whole
    row's). Summed over the group that is the whole rows' token mean times cp, which the data-parallel mean over the
    cp ranks divides, as it divides the gathered loss every rank computes otherwise; the logits are never
    gathered. Exact only for a token mean (`setup(loss="token_mean")` says it is one)."""

    def loss(out: Any, targets: Any) -> torch.Tensor:
        if not isinstance(targets, torch.Tensor) or targets.dim() < 2:
            raise ParatrainError(
                "setup(loss='token_mean') under context parallelism cuts the targets like the inputs, one per token "
                f"along dimension 1; these targets are {type(targets).__name__} "
                f"{tuple(targets.shape) if isinstance(targets, torch.Tensor) else ''}: use loss='any'")
        local = share.cut(targets, targets.shape[1])
        whole, part = _counted(targets), _counted(local)
        taken = loss_fn(out, local)
        if part == 0:  # none of this share's tokens counts: its mean is 0/0, its weight 0
            return torch.nan_to_num(taken) * 0.0
        return taken * (share.size * part / whole)

    share.own_tokens = True
    try:
        yield loss
    finally:
        share.own_tokens = False


def takes_positions(model: nn.Module) -> bool:
    try:
        return "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def gives_positions(model: nn.Module) -> bool:
    """Whether context parallelism can give the model its share's global positions: its forward takes
    `position_ids`, or it is an nn.Sequential some of whose children do (`_with_positions` hands them on)."""
    return takes_positions(model) or (isinstance(model, nn.Sequential) and any(takes_positions(c) for c in model))


def _with_positions(model: nn.Sequential) -> Callable[..., Any]:
    """An nn.Sequential's forward that gives `position_ids` to the children that take them."""
    children = [(child, takes_positions(child)) for child in model]

    def forward(value: Any, position_ids: torch.Tensor | None = None) -> Any:
        for child, positions in children:
            value = child(value, position_ids=position_ids) if positions else child(value)
        return value

    return forward


def _documents(model: nn.Module, hf_unpadded: bool, length: int, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Documents:
    """The documents of this forward's rows (before they are cut): the `document_ids` the model is given, or those
    a Hugging Face model called without a padding mask (`hf_unpadded`) and without a cache reads from restarting
    `position_ids` itself (it is given ones instead, and its documents are applied here)."""
    given = kwargs.get("document_ids")
    if isinstance(given, torch.Tensor) and given.dim() == 2 and given.shape[1] == length:
        return Documents(given, False)
    positions = kwargs.get("position_ids")
    if not hf_unpadded or not isinstance(positions, torch.Tensor) or positions.shape[-1] != length:
        return Documents(None, False)
    if _caches(model, kwargs):
        return Documents(None, False)
    return Documents(packed_documents(positions.expand(_rows(args, kwargs, positions), -1)), True)


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any], positions: torch.Tensor) -> int:
    """Rows of the batch (position ids are sometimes one row for all)."""
    rows = [t.shape[0] for t in tensors_in((args, kwargs)) if t.dim() >= 2 and t is not positions]
    return rows[0] if rows else positions.shape[0]


def _caches(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether a Hugging Face forward builds a key/value cache (then it reads no documents from positions)."""
    if kwargs.get("past_key_values") is not None:
        return True
    use = kwargs.get("use_cache")
    return bool(getattr(getattr(model, "config", None), "use_cache", False) if use is None else use)


def _no_padding_mask(model: nn.Module) -> inspect.Signature | None:
    """The forward's signature where the model is a Hugging Face model taking `attention_mask` (a 2-D padding mask,
    ones: attend), to which a call without one passes ones (see the module docstring); None for other models,
    whose `attention_mask` may mean anything."""
    if not any(c.__module__.startswith("transformers.") for c in type(model).__mro__):
        return None
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    return signature if "attention_mask" in signature.parameters else None


def _passes_mask(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return True  # the call itself is wrong: the model's own error says how
    return bound.get("attention_mask") is not None
