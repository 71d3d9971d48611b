"""The model zoo: small models in the layouts people train, each with a batch maker, a loss and the
tolerances every strategy must meet against the plain-PyTorch reference (`zoo.reference`).

    case = zoo.MODELS["gpt"]
    model = case.build(seed=0)                    # same weights for the same seed, in any process
    inputs, targets = case.batch(seed=1, rows=8)
    loss = case.loss_fn(model(inputs), targets)

| case | what it exercises |
| --- | --- |
| gpt, gpt_dropout | nanoGPT: tok_emb + pos_emb, ModuleList blocks, tied head, view(b, t, h, d); dropout 0 / 0.1 |
| gpt_flat | the GPT with its embeddings one child and three blocks as top-level children, untied head |
| llama, llama_tied | RMSNorm, rotary embeddings, SwiGLU, no biases, ModuleList blocks; separate / tied head |
| cnn_bn, cnn_bn_dropout | traced CNN (flatten in forward) with BatchNorm; without / with Dropout |
| resnet50 | torchvision ResNet-50 at 32x32, 4 classes (slow: ~25M parameters) |
| mlp | nn.Sequential of Linear/Tanh: the control, one tensor between layers |
| tied_seq | nn.Sequential language model whose head is tied to its embedding (the tie alone) |
| dict_io | forward(dict) -> dict: {"input_ids", "mask"} -> {"logits"} |
| tuple_seq | nn.Sequential whose layers pass (hidden, skip) tuples |
| hf_gpt2, hf_llama, hf_bert, hf_bert_kwargs | transformers models from tiny configs (ModelOutput, kwargs) |
| hf_llama_lora | the Llama with LoRA adapters from `peft`: frozen base weights, only the adapters train |

`zoo.ARCHS` is a second registry, kept apart so the correctness matrix does not run it: architectures as their
libraries build them (zoo/archs.py), every setting but the sizes at the library's default, for the architecture
sweep (tests/archs_verdicts.py, `make test-archs`); zoo/causal_lms.py adds every causal LM transformers knows.

| arch | what it brings |
| --- | --- |
| qwen2, mistral | GQA decoders (2 key/value heads), Mistral's sliding window |
| gemma2 | GQA, soft-capped logits and attention, pre- and post-norms, head_dim apart from the width |
| phi3 | fused projections: qkv_proj and gate_up_proj |
| gpt_neox | fused query_key_value, parallel residual, partial rotary |
| opt | learned positions, functional dropout 0.1 (its default) |
| mixtral, qwen2_moe | mixture of experts: top-2 routing over 4 experts; Qwen2-MoE adds a gated shared expert |
| t5 | encoder-decoder, relative position buckets, dropout 0.1 as modules and as a function |
| vit | torchvision VisionTransformer: class token, nn.MultiheadAttention (fused in_proj) |
| convnext, convnext_sd | torchvision ConvNeXt: LayerNorm2d, layer scale; stochastic depth 0 / 0.1 (`bernoulli_`) |
| swin | torchvision Swin (Swin-T's settings): shifted windows, patch merging, stochastic depth 0.2 |
| efficientnet | torchvision EfficientNet (B0's settings): MBConv, squeeze-excitation, BatchNorm, stochastic depth |

Each module holds one family; this file only registers them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from . import archs, data, gpt, hf, llama, structured, vision
from .case import (
    ADAPTERS,
    BATCH_SHAPE,
    BATCHNORM,
    DICT_IO,
    DROPOUT,
    HF,
    MODULELIST,
    SLOW,
    TIED,
    TRACED,
    TUPLE_IO,
    Tolerance,
    ZooCase,
)

FP32 = Tolerance(loss=1e-5, atol=1e-6, rtol=1e-3)
"""Measured (tests/test_zoo.py, splitting each batch into 2 or 4 row-weighted micro-batches): losses move
by at most 8.3e-7 and no weight by more than 0.015 of this tolerance (at most 1.2e-7 absolute)."""
BF16 = Tolerance(loss=5e-3, atol=1e-5, rtol=0.05)
"""Measured the same way under autocast: losses move by at most 8.3e-4 and weights by at most 0.34 of this
tolerance (BERT's classifier bias). An untrained tensor fails it; a float32 run passes it, which is why
bf16 runs are also held to `compare.AUTOCAST_FLOOR`."""


def _tol(fp32: Tolerance = FP32, bf16: Tolerance = BF16) -> dict[str, Tolerance]:
    return {"fp32": fp32, "bf16": bf16}


_DECODER = frozenset({MODULELIST, BATCH_SHAPE, TRACED})
_CASES = [
    ZooCase(name="gpt", about="GPT decoder: tok_emb/pos_emb, ModuleList blocks, tied head, view(b,t,h,d), p=0",
            build=gpt.build_gpt, batch=data.lm_batch, loss_fn=data.lm_loss, tolerances=_tol(),
            tags=_DECODER | {TIED}, lr=0.2),
    ZooCase(name="gpt_dropout", about="the GPT decoder with dropout p=0.1 (embeddings, attention, residuals)",
            build=partial(gpt.build_gpt, dropout=0.1), batch=data.lm_batch, loss_fn=data.lm_loss,
            tolerances=_tol(), tags=_DECODER | {TIED, DROPOUT}, lr=0.2),
    ZooCase(name="gpt_flat", about="GPT laid out flat: embeddings one child, blocks top-level children, untied",
            build=gpt.build_flat_gpt, batch=data.lm_batch, loss_fn=data.lm_loss, tolerances=_tol(),
            tags=frozenset({BATCH_SHAPE, TRACED}), lr=0.2),
    ZooCase(name="llama", about="LLaMA block: RMSNorm, rotary, SwiGLU, no biases, ModuleList, separate head",
            build=llama.build_llama, batch=data.lm_batch, loss_fn=data.lm_loss, tolerances=_tol(),
            tags=_DECODER, lr=0.5),
    ZooCase(name="llama_tied", about="the LLaMA decoder with its head tied to the token embedding",
            build=partial(llama.build_llama, tied=True), batch=data.lm_batch, loss_fn=data.lm_loss,
            tolerances=_tol(), tags=_DECODER | {TIED}, lr=0.5),
    ZooCase(name="cnn_bn", about="traced CNN with BatchNorm2d, no dropout",
            build=vision.build_cnn, batch=data.image_batch, loss_fn=data.class_loss, tolerances=_tol(),
            tags=frozenset({BATCHNORM, TRACED})),
    ZooCase(name="cnn_bn_dropout", about="traced CNN with BatchNorm2d and Dropout(0.3)",
            build=partial(vision.build_cnn, dropout=0.3), batch=data.image_batch, loss_fn=data.class_loss,
            tolerances=_tol(), tags=frozenset({BATCHNORM, DROPOUT, TRACED})),
    ZooCase(name="resnet50", about="torchvision ResNet-50 at 32x32, 4 classes",
            build=vision.build_resnet50, batch=partial(data.image_batch, size=32), loss_fn=data.class_loss,
            tolerances=_tol(), tags=frozenset({BATCHNORM, TRACED, SLOW}), lr=0.01),
    ZooCase(name="mlp", about="nn.Sequential MLP: the layout every strategy handles (the control)",
            build=structured.build_mlp, batch=data.regression_batch, loss_fn=data.mse, tolerances=_tol(), lr=0.1),
    ZooCase(name="tied_seq", about="nn.Sequential LM, head tied to the embedding: a tie with no other hurdle",
            build=structured.build_tied_sequential, batch=data.lm_batch, loss_fn=data.lm_loss, tolerances=_tol(),
            tags=frozenset({TIED}), lr=0.5),
    ZooCase(name="dict_io", about="forward(dict) -> dict: {'input_ids', 'mask'} -> {'logits'}, masked pooling",
            build=structured.build_dict_classifier, batch=data.token_class_batch, loss_fn=data.dict_class_loss,
            tolerances=_tol(), tags=frozenset({DICT_IO, TRACED}), lr=0.2),
    ZooCase(name="tuple_seq", about="nn.Sequential whose layers pass (hidden, skip) tuples",
            build=structured.build_tuple_sequential, batch=data.regression_batch, loss_fn=data.mse,
            tolerances=_tol(), tags=frozenset({TUPLE_IO}), lr=0.1),
    ZooCase(name="hf_gpt2", about="transformers GPT2LMHeadModel: Conv1D attention, tied lm_head, ModelOutput",
            build=hf.build_gpt2, batch=data.lm_batch, loss_fn=data.hf_lm_loss, tolerances=_tol(),
            tags=frozenset({HF, TIED, MODULELIST, TRACED}), lr=0.5),
    ZooCase(name="hf_llama", about="transformers LlamaForCausalLM: GQA, rotary passed to every layer, ModelOutput",
            build=hf.build_llama, batch=data.lm_batch, loss_fn=data.hf_lm_loss, tolerances=_tol(),
            tags=frozenset({HF, MODULELIST, TRACED}), lr=0.5),
    ZooCase(name="hf_llama_lora", about="LoRA (peft) on the transformers Llama: base frozen, adapters train",
            build=hf.build_llama_lora, batch=data.lm_batch, loss_fn=data.hf_lm_loss, tolerances=_tol(),
            tags=frozenset({HF, MODULELIST, TRACED, ADAPTERS}), lr=0.5),
    ZooCase(name="hf_bert", about="transformers BertForSequenceClassification on input_ids (positional)",
            build=hf.build_bert, batch=hf.bert_ids_batch, loss_fn=data.hf_class_loss, tolerances=_tol(),
            tags=frozenset({HF, MODULELIST, TRACED}), lr=0.2),
    ZooCase(name="hf_bert_kwargs", about="BERT through a kwargs adapter: {'input_ids', 'attention_mask'} padded",
            build=hf.build_bert_kwargs, batch=hf.bert_kwargs_batch, loss_fn=data.hf_class_loss, tolerances=_tol(),
            tags=frozenset({HF, MODULELIST, DICT_IO, TRACED}), lr=0.2),
]

MODELS: dict[str, ZooCase] = {case.name: case for case in _CASES}

_LM = frozenset({HF, MODULELIST, TRACED})


def _lm(name: str, about: str, build: Callable[[int], nn.Module], *tags: str) -> ZooCase:
    return ZooCase(name=name, about=about, build=build, batch=data.lm_batch, loss_fn=data.hf_lm_loss,
                   tolerances=_tol(), tags=_LM | set(tags), lr=0.2)


def _image(name: str, about: str, build: Callable[[int], nn.Module], *tags: str) -> ZooCase:
    return ZooCase(name=name, about=about, build=build, batch=data.image_batch, loss_fn=data.class_loss,
                   tolerances=_tol(), tags=frozenset({TRACED, *tags}), lr=0.05)


_ARCH_CASES = [
    _lm("qwen2", "transformers Qwen2ForCausalLM: GQA, q/k/v biases", archs.build_qwen2),
    _lm("mistral", "transformers MistralForCausalLM: GQA, sliding-window attention", archs.build_mistral),
    _lm("gemma2", "transformers Gemma2ForCausalLM: GQA, soft-capping, four norms a block, head_dim 16",
        archs.build_gemma2),
    _lm("phi3", "transformers Phi3ForCausalLM: fused qkv_proj and gate_up_proj", archs.build_phi3),
    _lm("gpt_neox", "transformers GPTNeoXForCausalLM: fused query_key_value, parallel residual", archs.build_gpt_neox),
    _lm("opt", "transformers OPTForCausalLM: learned positions, F.dropout 0.1", archs.build_opt, DROPOUT),
    _lm("mixtral", "transformers MixtralForCausalLM: top-2 of 4 experts", archs.build_mixtral),
    _lm("qwen2_moe", "transformers Qwen2MoeForCausalLM: top-k experts and a gated shared expert",
        archs.build_qwen2_moe),
    ZooCase(name="t5", about="transformers T5ForConditionalGeneration: encoder-decoder, dropout 0.1",
            build=archs.build_t5, batch=archs.t5_batch, loss_fn=data.hf_lm_loss, tolerances=_tol(),
            tags=frozenset({HF, MODULELIST, TRACED, DICT_IO, DROPOUT}), lr=0.2),
    _image("vit", "torchvision VisionTransformer: class token, nn.MultiheadAttention", archs.build_vit),
    _image("convnext", "torchvision ConvNeXt: LayerNorm2d, layer scale, no stochastic depth", archs.build_convnext),
    _image("convnext_sd", "torchvision ConvNeXt with stochastic depth 0.1 (bernoulli_ per sample)",
           partial(archs.build_convnext, stochastic_depth=0.1), DROPOUT),
    _image("swin", "torchvision SwinTransformer: shifted windows, patch merging, stochastic depth 0.2",
           archs.build_swin, DROPOUT),
    _image("efficientnet", "torchvision EfficientNet: MBConv, squeeze-excitation, BatchNorm, stochastic depth",
           archs.build_efficientnet, BATCHNORM, DROPOUT),
]

ARCHS: dict[str, ZooCase] = {case.name: case for case in _ARCH_CASES}

__all__ = ["ARCHS", "MODELS", "Tolerance", "ZooCase"]
