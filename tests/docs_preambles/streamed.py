"""docs/usage.md's streamed loop: a run, a tiny Hugging Face Llama (its forward takes the batch's fields by name),
small sizes, a next-token loss."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import paratrain

run = paratrain.setup(strategy="ddp", checkpoint_dir="ckpt")
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, use_cache=False))
model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
seq_len, global_batch, epochs = 16, 4, 2


def loss_fn(out, ids):
    return torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
