"""Real Hugging Face `transformers` models from tiny configs: built offline from the config alone, no
weights downloaded. What they add over the hand-written models: `ModelOutput` return values (the loss
reads `.logits`), keyword arguments, library-internal layouts (GPT-2's fused `Conv1D` attention and tied
`lm_head`; Llama passing rotary embeddings from the model into every layer; BERT's token-type embeddings,
pooler and padding mask). Dropout is off (p=0) in every config, so the cases are comparable under any
layout today."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from .case import seeded
from .data import SEQ, VOCAB, token_class_batch

TINY = {"vocab_size": VOCAB, "max_position_embeddings": SEQ, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, "use_cache": False}
"""use_cache=False: training needs no key/value cache, and eval outputs stay tensors (no DynamicCache)."""


def _transformers() -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may reach the network, even by accident
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers


def build_gpt2(seed: int) -> nn.Module:
    tf = _transformers()
    cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, **{k: v for k, v in TINY.items() if k != "max_position_embeddings"})
    with seeded(seed):
        return tf.GPT2LMHeadModel(cfg)


def build_llama(seed: int) -> nn.Module:
    tf = _transformers()
    cfg = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attention_dropout=0.0, tie_word_embeddings=False, **TINY)
    with seeded(seed):
        return tf.LlamaForCausalLM(cfg)


def build_llama_lora(seed: int) -> nn.Module:
    """Hugging Face Llama with LoRA adapters (the `peft` package) on its attention and MLP projections: the base
    weights frozen, the adapters the only trainable parameters (peft starts B at zero, A at random)."""
    import peft

    model = build_llama(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])
    with seeded(seed + 1):
        return peft.get_peft_model(model, config)  # type: ignore[no-any-return]


def build_bert(seed: int) -> nn.Module:
    tf = _transformers()
    cfg = tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        classifier_dropout=0.0, **TINY)
    with seeded(seed):
        return tf.BertForSequenceClassification(cfg)


class Kwargs(nn.Module):
    """`model(inputs)` -> `hf_model(**inputs)`: the adapter a dict batch needs to reach a Hugging Face
    forward that takes keyword arguments (input_ids=, attention_mask=)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: dict[str, torch.Tensor]) -> Any:
        return self.model(**inputs)


def build_bert_kwargs(seed: int) -> nn.Module:
    return Kwargs(build_bert(seed))


def bert_ids_batch(seed: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_class_batch`'s token ids alone (padding attended to, as without an attention mask)."""
    inputs, labels = token_class_batch(seed, rows)
    return inputs["input_ids"], labels


def bert_kwargs_batch(seed: int, rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`token_class_batch` under the names BERT's forward takes: input_ids and attention_mask."""
    inputs, labels = token_class_batch(seed, rows)
    return {"input_ids": inputs["input_ids"], "attention_mask": inputs["mask"].long()}, labels
