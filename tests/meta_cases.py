"""The models the meta-device tests build (tests/meta_worker.py under each layout, tests/test_meta_build.py in one
process): Hugging Face Llama and GPT-2 from tiny configs with their library's defaults (cache on, SDPA, GPT-2's
tied head), and the zoo's GPT (a tied head, a causal-mask buffer), with the data and loss they train on."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

os.environ["HF_HUB_OFFLINE"] = "1"

VOCAB, SEQ, ROWS, GLOBAL_BATCH = 64, 16, 24, 8


def llama_config() -> Any:
    import transformers as tf

    return tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)


def gpt2_config() -> Any:
    import transformers as tf

    # dropout off: how random calls are placed under each layout is tests/test_random_calls.py's business
    return tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, bos_token_id=1,
                         eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def build(name: str) -> nn.Module:
    """The model as its library builds it, on whatever device is current."""
    import transformers as tf

    transformers_logging()
    if name == "llama":
        return tf.LlamaForCausalLM(llama_config())
    if name == "gpt2":
        return tf.GPT2LMHeadModel(gpt2_config())
    from zoo.gpt import GPT, GPTConfig

    return GPT(GPTConfig())


def transformers_logging() -> None:
    import transformers as tf

    tf.logging.set_verbosity_error()


MODELS = ("llama", "gpt2", "gpt")


def models(layout: str) -> tuple[str, ...]:
    """The zoo's GPT sizes its attention by the whole width (`split(c, dim=2)`): tensor parallelism refuses it by
    name (tests/matrix_refused.txt), so layouts with tp run the two Hugging Face models, as does `auto`, which
    may choose tp for the first model and keeps its choice for the rest."""
    return MODELS[:2] if "tp" in layout.split("+") or layout == "auto" else MODELS
FILES: dict[str, Callable[[str], str]] = {
    "llama": lambda root: os.path.join(root, "llama"),  # save_pretrained, sharded with an index
    "gpt2": lambda root: os.path.join(root, "gpt2", "model.safetensors"),  # one safetensors file
    "gpt": lambda root: os.path.join(root, "gpt.pt"),  # a torch.save'd state dict
}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Linear in the gradients, so the layouts' float reassociation stays at float noise in the weights (Adam's
    normalisation turns a gradient near zero's noise into a step of the learning rate's size)."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def write_checkpoints(root: str) -> None:
    """Each model's pretrained weights in the format it is read from: a sharded save_pretrained directory, one
    safetensors file, a torch.save'd state dict."""
    for name in MODELS:
        torch.manual_seed(1)
        model = build(name)
        path = FILES[name](root)
        if name == "llama":
            model.save_pretrained(path, max_shard_size="40KB")
        elif name == "gpt2":
            model.save_pretrained(os.path.dirname(path))
        else:
            os.makedirs(root, exist_ok=True)
            torch.save(model.state_dict(), path)


def load(name: str, root: str) -> nn.Module:
    """The plain way to start from those weights."""
    if name == "gpt":
        model = build(name)
        model.load_state_dict(torch.load(FILES[name](root), weights_only=True))
        return model
    import transformers as tf

    folder = FILES[name](root)
    folder = folder if os.path.isdir(folder) else os.path.dirname(folder)
    return tf.AutoModelForCausalLM.from_pretrained(folder).train()  # type: ignore[no-any-return]


def plain_run(name: str, root: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same steps in one process, with no paratrain: the weights and losses every layout must reach."""
    model = load(name, root)
    opt = optimizer(model)
    x, y = data()
    losses = []
    for step in range(ROWS // GLOBAL_BATCH):
        rows = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = loss_fn(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def held_bytes(model: nn.Module) -> int:
    """Bytes of parameters a rank stores: a DTensor's local piece, a pipeline rank's stages (a tied weight once)."""
    from paratrain.parallel.tensor import local_part

    return sum(local_part(p).numel() * p.element_size() for p in model.parameters())


def read_export(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of an export (one file or shards), as a plain loader would read them."""
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(load_file(os.path.join(folder, file)))
    return out


def record(run: Any, out: str, losses: Any, held: Any = None) -> None:
    """A worker's results for its test: what this rank holds (`held-RANK.json`), and rank 0's losses."""
    import json

    if held is not None:
        with open(os.path.join(out, f"held-{run.rank}.json"), "w") as f:
            json.dump(held, f)
    if run.is_main:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(losses, f)
