"""Sharded, resumable data loading.

The global order of samples is a function of (seed, epoch) alone; each global batch of
`batch_size * replicas` samples is cut into one contiguous share per replica. So a script run with
1, 2 or 3 workers at the same global batch trains on the same batches, and a checkpoint only needs
the epoch and how many samples of it were consumed to resume exactly, even on a different world size:

    epoch order  : p0 p1 p2 p3 p4 p5 p6 p7 p8 p9 ...
    global batch : [p0 p1 p2 p3][p4 p5 p6 p7] ...      (batch_size 2 per worker, 2 workers)
    rank 0 / 1   :  p0 p1|p2 p3  p4 p5|p6 p7

One file per step: `order` reads what the DataLoader asks for (shuffle, a sampler, a batch sampler) and
draws an epoch's order from it; `plan` cuts the order into this replica's shares and weighs a short
batch's shares by their rows; `loader` iterates them with the DataLoader's own loading options.

Streams take the same path once made indexable: `sources` says what a stream is made of (named shards,
each readable from its start), `formats` reads shard files (jsonl, parquet, arrow, WebDataset tar), `hf`
adapts a Hugging Face streaming dataset, `stream` is the user's entry point for files, `indexed` numbers
the shards' rows and draws the order over them, `packing` packs documents into fixed-length sequences.
"""

from .loader import EpochSampler, ShardedLoader, claim_weight
from .order import epoch_order
from .packing import document_mask, pack
from .plan import Weight, split_evenly
from .stream import Stream, arrow, jsonl, parquet, webdataset

__all__ = ["EpochSampler", "ShardedLoader", "Stream", "Weight", "arrow", "claim_weight", "document_mask",
           "epoch_order", "jsonl", "pack", "parquet", "split_evenly", "webdataset"]
