"""Token packing: variable-length documents concatenated into fixed-length sequences, with their boundaries.

Each shard is packed by itself, from its first document, in its own order:

    documents      [a a a] [b b b b b] [c c] [d d d d]      seq_len 4
    input_ids      a a a b | b b b b | c c d d | (d d: the shard's remainder, dropped unless pad= is given)
    position_ids   0 1 2 0 | 0 1 2 3 | 0 1 0 1
    document_ids   0 0 0 1 | 0 0 0 0 | 0 0 1 1              (which document of this sequence a token is in)

so a shard's packed sequences are the same whoever packs it, and they are then ordered like any stream's
samples (shuffled by (seed, epoch) if asked, cut into global batches, shared over replicas). A document
that runs past the end of a sequence continues in the next one, its positions starting at 0 again.
`document_mask` turns `document_ids` into the block-diagonal causal mask that keeps attention inside each
document.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import ParatrainError
from .sources import Listed, Source, resolve
from .stream import Stream


class PackedSource:
    """Another source's shards, each packed into sequences of `seq_len` tokens."""

    def __init__(self, inner: Source, seq_len: int, tokens: Callable[[Any], Any], pad: int | None) -> None:
        self.inner, self.seq_len, self.tokens, self.pad = inner, seq_len, tokens, pad
        self.names, self.paths = inner.names, inner.paths

    def length(self, shard: int) -> int | None:
        return None  # known only once the shard's documents are tokenized

    def read(self, shard: int, seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
        return packed(map(self.tokens, self.inner.read(shard, seed)), self.seq_len, self.pad,
                      self.names[shard])

    def open(self, shard: int, seed: int = 0) -> Listed:
        return Listed(list(self.read(shard, seed)))


def packed(documents: Iterator[Any], seq_len: int, pad: int | None = None,
           where: str = "the stream") -> Iterator[dict[str, torch.Tensor]]:
    """Sequences of `seq_len` tokens from `documents` (each a list or 1-d tensor of token ids)."""
    ids: list[int] = []
    positions: list[int] = []
    docs: list[int] = []
    for document in documents:
        tokens = document.tolist() if isinstance(document, torch.Tensor) else list(document)
        if tokens and not isinstance(tokens[0], int):
            raise ParatrainError(
                f"a document of {where} is not a list of token ids (its first item is a "
                f"{type(tokens[0]).__name__}); tokenize before packing, e.g. pack(stream, seq_len, "
                "tokens=lambda sample: tokenizer(sample['text'])['input_ids'])"
            )
        start = 0
        while start < len(tokens):
            take = min(seq_len - len(ids), len(tokens) - start)
            doc = docs[-1] + 1 if docs else 0
            ids.extend(tokens[start : start + take])
            positions.extend(range(take))
            docs.extend([doc] * take)
            start += take
            if len(ids) == seq_len:
                yield _sequence(ids, positions, docs)
                ids, positions, docs = [], [], []
    if ids and pad is not None:
        rest = seq_len - len(ids)
        yield _sequence(ids + [pad] * rest, positions + [0] * rest, docs + [-1] * rest)


def _sequence(ids: list[int], positions: list[int], docs: list[int]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "position_ids": torch.tensor(positions, dtype=torch.long),
            "document_ids": torch.tensor(docs, dtype=torch.long)}


def pack(stream: Any, seq_len: int, *, key: str = "input_ids", tokens: Callable[[Any], Any] | None = None,
         pad: int | None = None, shuffle: bool | None = None) -> Stream:
    """`stream` (a paratrain stream, a Hugging Face streaming dataset, or a protocol IterableDataset) packed
    into sequences of `seq_len` tokens: samples {"input_ids", "position_ids", "document_ids"}, each a
    LongTensor of `seq_len`. A document's tokens are `sample[key]`, or `tokens(sample)` when given. Each
    shard's remainder is dropped, or padded with `pad` (document id -1) when given. `shuffle` defaults to
    the stream's."""
    if seq_len < 1:
        raise ParatrainError(f"pack(seq_len={seq_len}): use a sequence length of at least 1")
    found = resolve(stream)
    if found is None:
        raise ParatrainError(
            f"pack takes a stream (paratrain.data.jsonl(...), a Hugging Face streaming dataset, or an IterableDataset "
            f"with shards and read_shard), not the map-style {type(stream).__name__}; pack a map-style dataset's "
            "documents ahead of time into a dataset of sequences"
        )
    source, shuffled = found
    read = tokens if tokens is not None else _Field(key)
    return Stream(PackedSource(source, seq_len, read, pad), shuffled if shuffle is None else shuffle)


class _Field:
    """sample[key], picklable (DataLoader workers started by spawn receive the stream pickled)."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, sample: Any) -> Any:
        try:
            return sample[self.key]
        except (KeyError, TypeError, IndexError):
            raise ParatrainError(
                f"pack: a sample has no {self.key!r} field to pack; name its token field with key=, or give "
                "tokens=a function from a sample to its token ids"
            ) from None


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed sequences: True where query position i may attend to key position j
    (j <= i, same document). `document_ids` is (batch, seq); the mask is (batch, seq, seq)."""
    seq = document_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return (document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)) & causal
