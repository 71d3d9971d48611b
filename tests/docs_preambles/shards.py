"""Two jsonl shards of tokenized documents (`shards/*.jsonl`, {"input_ids": [...]} per line), 3 to 12 tokens each."""

import json
from pathlib import Path

import torch


def files(folder: Path) -> None:
    g = torch.Generator().manual_seed(0)
    (folder / "shards").mkdir()
    for shard in range(2):
        with open(folder / "shards" / f"part-{shard}.jsonl", "w") as f:
            for _ in range(32):  # 15 and 13 packed rows of 16 tokens: 7 global batches of 4
                n = int(torch.randint(3, 13, (), generator=g))
                f.write(json.dumps({"input_ids": torch.randint(0, 64, (n,), generator=g).tolist()}) + "\n")
