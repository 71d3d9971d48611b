"""The README's meta-device script: a tiny Llama saved as `pretrained/`, rows of token ids, a next-token loss."""

from pathlib import Path

import torch
from torch.utils.data import TensorDataset


def files(folder: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(folder / "pretrained")


ids = torch.randint(0, 64, (32, 12), generator=torch.Generator().manual_seed(0))
data = TensorDataset(ids, ids)
val_x, val_y = ids[:4], ids[:4]
epochs = 1


def loss_fn(out, labels):
    return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
