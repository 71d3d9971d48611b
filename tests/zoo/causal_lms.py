"""Every causal-LM architecture the installed `transformers` knows, built from a tiny config: the part of the zoo
that grows by itself when the library adds a model.

    for name, found in causal_lms.survey().items():      # model_type -> Probe
        found.case                                       # a ZooCase, or None with found.reason

The tiny config sets the size fields by the config's own names (its dataclass fields, through its
`attribute_map`): hidden 64, 2 layers, 4 heads, 2 key/value heads where the config has them, intermediate 128,
vocabulary 64, head_dim 16 where the config fixes one, 4 experts of width 32 where it has experts, and token ids
inside the vocabulary. Every other setting keeps its default, dropout included: what a user gets from the
library. A model that cannot be built that way, or whose plain training step cannot run on an LM batch of token
ids (a multimodal model, one that needs other inputs, one without logits), is recorded with the reason instead.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from .case import HF, MODULELIST, TRACED, ZooCase, seeded
from .data import VOCAB, hf_lm_loss, lm_batch
from .hf import _transformers

SIZES: dict[str, int] = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": VOCAB,
                         "num_local_experts": 4, "moe_intermediate_size": 32}
"""The size fields, under the names the config's `attribute_map` gives them, and under every alias it also has
(an encoder-decoder's decoder_layers beside its encoder_layers); a config without one keeps its default."""
ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("d_model", "n_embd", "n_embed", "embed_dim", "model_dim", "word_embed_proj_dim"),
    "num_hidden_layers": ("num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers"),
    "num_attention_heads": ("num_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads"),
    "num_key_value_heads": ("num_kv_heads", "n_kv_heads", "multi_query_group_num"),
    "intermediate_size": ("n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "encoder_ffn_dim", "decoder_ffn_dim"),
    "num_local_experts": ("num_experts", "n_routed_experts", "moe_num_experts"),
    "moe_intermediate_size": ("expert_intermediate_size", "expert_ffn_hidden_size"),
}
"""Names configs give the same fields without mapping them."""
EXTRA: dict[str, int] = {"head_dim": 16, "rotary_dim": 16, "shared_expert_intermediate_size": 64,
                         "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                         "v_head_dim": 16, "qk_head_dim": 16, "n_group": 1, "topk_group": 1,
                         "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0}
"""Fields set where the config has them and does not leave them None: sizes whose defaults a tiny model cannot
keep (a head_dim of 256, a rotary width past the head's, latent-attention ranks of 512, token ids past the
vocabulary). Latent attention (qk_rope_head_dim) takes its rotary width as head_dim."""
TOP_K = 2
"""Experts each token is routed to, where the default asks for more than the tiny config's 4 experts hold."""
PROBE_S = 60
"""Seconds a build plus one training step may take before the model is recorded as too slow to probe."""
ROWS = 4


@dataclass(frozen=True)
class Probe:
    """What building and stepping one architecture found."""

    model_type: str
    model_class: str
    case: ZooCase | None
    reason: str = ""
    """Why there is no case: what failed, in one line."""


def names() -> dict[str, str]:
    """model_type -> causal-LM class name, as the installed transformers maps them."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> Any:
    """The config of `model_type` with SIZES, EXTRA and TOP_K set under its own field names."""
    tf = _transformers()
    cls = tf.models.auto.configuration_auto.CONFIG_MAPPING[model_type]
    default = cls()
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(vars(default))
    settings: dict[str, Any] = {}
    for canonical, value in SIZES.items():
        for name in (cls.attribute_map.get(canonical, canonical), canonical, *ALIASES.get(canonical, ())):
            if name in fields and not (canonical == "num_key_value_heads" and getattr(default, name) is None):
                settings[name] = value
    for name, value in EXTRA.items():
        if name in fields and getattr(default, name, None) is not None:
            settings[name] = value
    if "qk_rope_head_dim" in settings and "head_dim" in settings:
        settings["head_dim"] = settings["qk_rope_head_dim"]
    top_k = cls.attribute_map.get("num_experts_per_tok", "num_experts_per_tok")
    if top_k in fields and isinstance(getattr(default, top_k), int) and getattr(default, top_k) > TOP_K:
        settings[top_k] = TOP_K
    return cls(**settings)


def build(model_type: str, seed: int) -> nn.Module:
    """The causal LM of `model_type` from its tiny config, the same weights for the same seed."""
    tf = _transformers()
    cfg = tiny_config(model_type)
    with seeded(seed):
        return getattr(tf, names()[model_type])(cfg)  # type: ignore[no-any-return]


def case_of(model_type: str) -> ZooCase:
    from . import BF16, FP32

    return ZooCase(name=f"lm:{model_type}", about=f"transformers {names()[model_type]} from a tiny config",
                   build=partial(build, model_type), batch=lm_batch, loss_fn=hf_lm_loss,
                   tolerances={"fp32": FP32, "bf16": BF16}, tags=frozenset({HF, MODULELIST, TRACED}), lr=0.1)


class _TooSlow(Exception):
    pass


@contextmanager
def _limit(seconds: int) -> Iterator[None]:
    """Raise _TooSlow in this (main) thread after `seconds`; a timer already running (a test's time limit) is
    put back with what it had left."""
    def expire(signum: int, frame: Any) -> None:
        raise _TooSlow(f"took over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    left, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - start), 1e-3), interval)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}".rstrip(": ")


def probe(model_type: str, seconds: int = PROBE_S) -> Probe:
    """Build `model_type` tiny and run one plain training step on an LM batch; the case, or why not."""
    cls_name = names()[model_type]
    stage = "config"
    try:
        with _limit(seconds):
            cfg = tiny_config(model_type)
            if getattr(cfg, "sub_configs", None):
                return Probe(model_type, cls_name, None, f"composite config ({', '.join(sorted(cfg.sub_configs))}): "
                                                         "multimodal or several models")
            stage = "build"
            model = build(model_type, 0)
            stage = "forward on input_ids"
            inputs, targets = lm_batch(0, ROWS)
            model.train()
            out = model(inputs)
            logits = getattr(out, "logits", None)
            if not isinstance(logits, torch.Tensor):
                return Probe(model_type, cls_name, None, f"output {type(out).__name__} has no logits tensor")
            if tuple(logits.shape) != (ROWS, inputs.shape[1], VOCAB):
                return Probe(model_type, cls_name, None,
                             f"logits of shape {tuple(logits.shape)}, not (rows, tokens, vocab {VOCAB})")
            stage = "backward"
            hf_lm_loss(out, targets).backward()
    except Exception as exc:  # noqa: BLE001 - any failure of the library's own model is this row's reason
        return Probe(model_type, cls_name, None, f"{stage}: {_first_line(exc)}")
    return Probe(model_type, cls_name, case_of(model_type))


def survey(only: list[str] | None = None) -> dict[str, Probe]:
    """Every causal-LM model_type (or those named), probed in this process one after the other."""
    torch.manual_seed(0)
    return {name: probe(name) for name in names() if only is None or name in only}
