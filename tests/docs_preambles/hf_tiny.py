"""A run on this process, a tiny Llama config (for `LlamaForCausalLM(config)` and meta builds) and one batch of
token ids; `files` saves a model of that config as `llama-pretrained/`."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: F401 (the blocks use them)

import paratrain


def tiny_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def files(folder: Path) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config()).save_pretrained(folder / "llama-pretrained")


config = tiny_config()
run = paratrain.setup()
first_inputs = x = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))
