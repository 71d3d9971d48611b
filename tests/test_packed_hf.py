"""Packed documents for a Hugging Face causal LM (docs/usage.md, "Packed documents for a Hugging Face model").

`data.pack` rows go to the model by name (`paratrain/_inputs.py`): `input_ids` and `position_ids` are passed, the
`document_ids` the forward does not take are left out. A tiny Llama at the library's defaults (SDPA attention)
trained on packed rows reaches the weights of the same documents trained one sequence each, the loss a mean over
the same tokens: with `config.use_cache = False` transformers reads the documents from where `position_ids`
restart; with the cache on it does not (transformers 5.x builds a cache in the training forward and skips its
packed-sequence detection when it has one), so that batch is refused unless it brings an `attention_mask`
(`data.document_mask`, 4-D, which SDPA takes as it is).

Every packed row holds two documents, so each row has as many predicted tokens as any other and the token mean
over a global batch is the mean of its rows' means: the `ddp` run (one row per worker) is then the same training.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import paratrain
from paratrain import data
from paratrain._inputs import call
from paratrain.errors import ParatrainError

ROWS = [(5, 3), (2, 6), (4, 4), (1, 7), (6, 2), (3, 5)]
"""Document lengths, two documents to a row of 8 tokens: packed, no document is cut."""
SEQ, VOCAB, STEPS = 8, 64, 3
TOL = 2e-5


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


class PackedDecoder(torch.nn.Module):
    """A user's RoPE decoder for packed rows: positions restart per document (`position_ids`), attention stays
    inside each document (`document_ids`, masked with `data.document_mask`) — the arguments docs/usage.md names."""

    def __init__(self) -> None:
        from moe_cases import RopeBlock

        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 32)
        self.blocks = torch.nn.ModuleList(RopeBlock(32) for _ in range(2))
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None].expand(input_ids.shape[0], -1)
        mask = data.document_mask(document_ids)[:, None] if document_ids is not None else None
        x = self.emb(input_ids)
        for block in self.blocks:
            x = _attend_within(block, x, position_ids, mask)
        return self.head(x)


def _attend_within(block: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """`moe_cases.RopeBlock` with an attention mask (is_causal without one)."""
    b, s, c = x.shape
    q, k, v = block.qkv(block.ln1(x)).view(b, s, 3, block.heads, c // block.heads).permute(2, 0, 3, 1, 4)
    q, k = block.rope(q, positions), block.rope(k, positions)
    attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    x = x + block.proj(attended.transpose(1, 2).reshape(b, s, c))
    return x + block.mlp(block.ln2(x))


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        return tiny_llama()
    return PackedDecoder()


def write_documents(folder: Path) -> str:
    """The documents as one jsonl shard, in row order."""
    g = torch.Generator().manual_seed(1)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "docs.jsonl"
    with path.open("w") as f:
        for lengths in ROWS:
            for n in lengths:
                f.write(json.dumps({"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()}) + "\n")
    return str(path)


def packed_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The next token of the same document; -100 (ignored) at each document's last token."""
    ids, docs = batch["input_ids"], batch["document_ids"]
    labels = torch.full_like(ids, -100)
    same = docs[:, 1:] == docs[:, :-1]
    labels[:, :-1] = torch.where(same, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    return labels


def loss_fn(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """The mean over the predicted tokens."""
    return F.cross_entropy(logits_of(out).flatten(0, 1), labels.flatten(), ignore_index=-100)


def logits_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def documents_of(batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The batch's documents, each its own sequence."""
    return [row[docs == d] for row, docs in zip(batch["input_ids"], batch["document_ids"]) for d in docs.unique()]


def unpacked_step(model: torch.nn.Module, documents: list[torch.Tensor]) -> float:
    """One plain step on the documents one sequence each, the loss the mean over all their predicted tokens."""
    total = sum(F.cross_entropy(logits_of(model(input_ids=d[None]))[0, :-1], d[1:], reduction="sum") for d in documents)
    loss = total / sum(len(d) - 1 for d in documents)
    loss.backward()
    return float(loss.detach())


def train(path: str, strategy: str, mask: bool, name: str = "llama") -> dict[str, Any]:
    """Packed training through paratrain, beside (on one process) the plain loop on the documents unpacked."""
    run = paratrain.setup(strategy=strategy, seed=0, accelerator="cpu", timeout_s=120)
    model = build(name)
    if not mask and name == "llama":
        model.config.use_cache = False  # transformers then masks each document from where position_ids restart
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    loader = run.prepare_loader(torch.utils.data.DataLoader(data.pack(data.jsonl(path), SEQ),
                                                            batch_size=run.per_worker_batch(2)))
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    losses, ref_losses = [], []
    for step, batch in enumerate(loader):
        if step == STEPS:
            break
        if mask:
            batch["attention_mask"] = data.document_mask(batch["document_ids"])[:, None]  # (batch, 1, seq, seq)
        losses.append(float(run.forward_backward(model, batch, packed_labels(batch), loss_fn)))
        optimizer.step()
        optimizer.zero_grad()
        if run.world_size == 1 or strategy == "cp":  # every cp rank holds the whole batch
            ref_losses.append(unpacked_step(reference, documents_of(batch)))
            ref_opt.step()
            ref_opt.zero_grad()
    weights = {k: v.detach().clone() for k, v in run.unwrap(model).state_dict().items()}
    ref_weights = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    run.close()
    return {"losses": losses, "ref_losses": ref_losses, "weights": weights, "ref_weights": ref_weights}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("mask", [False, True], ids=["position_ids", "document_mask"])
def test_packed_rows_train_as_the_documents_unpacked(tmp_path: Path, mask: bool) -> None:
    out = train(write_documents(tmp_path), "single", mask)
    assert len(out["losses"]) == STEPS
    assert out["losses"] == pytest.approx(out["ref_losses"], abs=TOL)
    assert max_diff(out["weights"], out["ref_weights"]) < TOL
    assert out["losses"][0] != out["losses"][-1]  # it trained: not two untouched models compared


def test_a_packed_batch_with_the_cache_on_and_no_mask_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = tiny_llama()
    row = next(iter(data.pack(data.jsonl(write_documents(tmp_path)), SEQ)))
    batch = {k: v[None] for k, v in row.items()}
    with pytest.raises(ParatrainError, match="use_cache = False"):
        call(model, batch)
    model.config.use_cache = False
    with pytest.warns(UserWarning, match="'document_ids' are not parameters of LlamaForCausalLM.forward"):
        out = call(model, batch)
    want = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
    assert torch.equal(out.logits, want.logits)


def test_a_model_that_takes_the_dict_gets_it_whole() -> None:
    class TakesDict(torch.nn.Module):  # the zoo's dict_io shape: forward(self, inputs) reads the dict
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(8, 4)

        def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
            return self.emb(inputs["input_ids"]) * inputs["mask"][..., None]

    model = TakesDict()
    batch = {"input_ids": torch.tensor([[1, 2]]), "mask": torch.tensor([[1.0, 0.0]])}
    assert torch.equal(call(model, batch), model(batch))
    ddp_like = torch.nn.DataParallel(model)  # wrappers are looked through: the user's forward decides
    assert torch.equal(call(ddp_like, batch), model(batch))


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_packed_rows_under_ddp_2_reach_the_one_process_weights(tmp_path: Path) -> None:
    path = write_documents(tmp_path)
    one = train(path, "single", False)
    two = paratrain.launch(train, path, "ddp", False, nproc=2, timeout=120)
    assert two["losses"] == pytest.approx(one["losses"], abs=TOL)
    assert max_diff(two["weights"], one["weights"]) < TOL


def test_peek_gives_the_first_batch_and_leaves_the_loader_where_it_was(tmp_path: Path) -> None:
    """`example=loader.peek()` (docs/usage.md, The Run): `next(iter(loader))` would use the batch up."""
    run = paratrain.setup(strategy="single", seed=0, accelerator="cpu")
    try:
        loader = run.prepare_loader(torch.utils.data.DataLoader(
            data.pack(data.jsonl(write_documents(tmp_path)), SEQ, shuffle=True), batch_size=2))
        before = torch.get_rng_state()
        example = loader.peek()
        assert torch.equal(torch.get_rng_state(), before)
        assert (loader.epoch, loader.consumed) == (0, 0)
        batches = list(loader)
        assert len(batches) == len(ROWS) // 2
        assert all(torch.equal(example[k], batches[0][k]) for k in batches[0])
        assert torch.equal(loader.peek()["input_ids"], next(iter(loader))["input_ids"])  # epoch 1's first batch
    finally:
        run.close()


@pytest.mark.procs
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["llama", "decoder"])
def test_packed_rows_under_cp_2_train_as_the_documents_unpacked(tmp_path: Path, name: str) -> None:
    """Each rank holds a head and a tail chunk of every row, so documents cross the shares: rows of (5, 3) tokens
    put document 1's first tokens on rank 0 and its last ones on rank 1 and the reverse for document 2."""
    sys.path.insert(0, str(Path(__file__).parent))
    out = paratrain.launch(train, write_documents(tmp_path), "cp", False, name, nproc=2, timeout=150)
    assert len(out["losses"]) == STEPS and out["losses"][0] != out["losses"][-1]
    assert out["losses"] == pytest.approx(out["ref_losses"], abs=TOL)
    assert max_diff(out["weights"], out["ref_weights"]) < TOL


def test_the_packed_decoder_masks_its_documents_in_one_process(tmp_path: Path) -> None:
    out = train(write_documents(tmp_path), "single", False, "decoder")
    assert out["losses"] == pytest.approx(out["ref_losses"], abs=TOL)
    assert max_diff(out["weights"], out["ref_weights"]) < TOL
