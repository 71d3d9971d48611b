"""Context parallelism against plain PyTorch (docs/parallelism.md, "Context parallelism").

Each layout's run (tests/moe_worker.py) trains a user RoPE decoder with SDPA and Hugging Face Llama (its library's
defaults: SDPA, the cache on; and without its cache, when transformers builds a mask from the positions) at
sequence 64 for three SGD steps, each rank computing its load-balanced share of every sequence: losses and exported
weights equal to one process's (1e-5). The shares, the masks taken as causal and the refusals run here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import moe_cases as cases
import pytest
import torch
from helpers import cli_env, paratrain
from torch import nn
from torch.nn import functional as F

from paratrain.errors import ParatrainError
from paratrain.parallel import step_state
from paratrain.parallel.context import Documents, apply_cp, means_causal, packed_documents, shares
from paratrain.parallel.dims import dims_for

RUNS = (("cp", 2, ("rope", "llama", "llama-nocache", "rope-seq")), ("fsdp+cp", 4, ("rope", "llama")),
        ("cp", 4, ("rope",)),
        ("tp+cp", 4, ("llama", "llama-nocache")), ("ddp+fsdp+cp", 8, ("rope", "llama")),
        ("cp-token_mean", 2, ("rope", "rope-ignored", "llama")), ("fsdp+cp-token_mean", 4, ("rope-ignored",)),
        ("cp+pp", 4, ("llama", "llama-nocache", "llama-meta", "rope-seq")), ("fsdp+cp+pp", 8, ("llama", "rope-seq")),
        ("tp+cp+pp", 8, ("llama-nocache",)))
"""A layout `NAME-token_mean` is told the loss is a token mean (`setup(loss="token_mean")`): each rank takes its own
tokens' loss, no logits gathered ("rope-ignored" leaves targets of -100 out, unevenly over the shares); `-meta` a
model built on the meta device."""
CHECKPOINTED = {"fsdp+cp": "full"}
"""Runs with activation checkpointing after the context step: the recomputation in the backward attends over the
gathered keys and values again, as the forward did."""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "world", "names"), RUNS, ids=[f"{r[0]}-{r[1]}" for r in RUNS])
def test_context_parallel_layouts_match_plain_pytorch(layout: str, world: int, names: tuple[str, ...],
                                                      tmp_path: Path) -> None:
    import meta_cases

    layout, _, loss = layout.partition("-")
    res = paratrain("run", "--nproc", str(world), "tests/moe_worker.py", layout, str(tmp_path), *names, timeout=240,
                    env=cli_env(MOE_CHECKPOINTING=CHECKPOINTED.get(layout, "none"), MOE_LOSS=loss or "any"))
    assert res.returncode == 0, res.stdout[-4000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    cp = dims_for(layout, world).cp
    for rank in range(world):  # each rank's model saw its share of every sequence
        seen = json.loads((tmp_path / f"held-{rank}.json").read_text())
        assert all(seen[name]["tokens"] == [cases.LONG_SEQ // cp] or name.endswith("-meta") and seen[name]["tokens"]
                   in ([0], [cases.LONG_SEQ // cp]) for name in names), (rank, seen)  # meta: later stages saw none
        assert all((seen[name]["tensor"][0] > 0) == ("tp" in layout.split("+")) for name in names), (rank, seen)
    for name in names:
        with step_state.using(step_state.StepState()):  # one process, outside any run an earlier test left active
            ref, ref_losses = cases.plain(name)
        assert losses[name] == pytest.approx(ref_losses, abs=1e-5), f"{name} under {layout}"
        got = meta_cases.read_export(str(tmp_path / name))
        worst = max((float((got[k] - ref[k]).abs().max()), k) for k in ref)
        assert worst[0] < 1e-5, f"{name} under {layout} {world}: weights differ from the plain loop's: {worst}"


def test_each_rank_holds_a_head_and_a_tail_chunk_of_every_sequence() -> None:
    assert shares(8, 2, 0).tolist() == [0, 1, 6, 7] and shares(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([shares(64, 4, r) for r in range(4)])
    assert sorted(every.tolist()) == list(range(64))  # every token once
    work = [int(shares(64, 4, r).sum()) for r in range(4)]  # causal attention's cost grows with the position
    assert len(set(work)) == 1, work
    with pytest.raises(ParatrainError, match="multiple of 8"):
        shares(60, 4, 0)


class _NoPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids)


class _ByHand(nn.Module):
    def __init__(self, masked: bool = False) -> None:
        super().__init__()
        self.emb, self.masked = nn.Embedding(8, 8), masked

    def forward(self, ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(ids)[:, None]
        if self.masked:  # causal, its first key padding: more than causal attention
            mask = torch.ones(x.shape[-2], x.shape[-2], dtype=torch.bool).tril()
            mask[1:, 0] = False
            return F.scaled_dot_product_attention(x, x, x, attn_mask=mask)
        return torch.softmax(x @ x.transpose(-1, -2), dim=-1) @ x


def test_what_context_parallelism_cannot_make_exact_is_refused_by_name() -> None:
    with pytest.raises(ParatrainError, match="_NoPositions.forward takes no position_ids"):
        apply_cp(_NoPositions(), None, 2, 0)
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ParatrainError, match="computes attention by hand"):
        apply_cp(_ByHand(), None, 2, 0)(ids)
    with pytest.raises(ParatrainError, match="passes its own mask"):
        apply_cp(_ByHand(masked=True), None, 2, 0)(ids)
    with pytest.raises(ParatrainError, match="neither the causal mask"):  # padding: no document rule makes it
        apply_cp(_ByHand(masked=True), None, 2, 0)(ids, document_ids=torch.zeros(2, 8, dtype=torch.long))


def test_documents_are_read_where_positions_restart_and_masked_within_each_share() -> None:
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7], [5, 6, 7, 8, 9, 10, 11, 12]])
    assert packed_documents(positions).tolist() == [[0] * 5 + [1] * 3, [0] * 8, [0] * 8]
    assert packed_documents(positions[1:]) is None  # one document a row (an offset is not a restart)
    head_and_tail = shares(8, 2, 0)  # places 0 1 6 7: document 0's first two tokens, document 1's last two
    docs = Documents(packed_documents(positions[:1]), False)
    within = docs.share(head_and_tail)
    assert within[0].tolist() == [[True, False, False, False], [True, True, False, False],
                                  [False, False, True, False], [False, False, True, True]]
    every = torch.cat([shares(8, 2, r) for r in range(2)])  # keys in rank order: 0 1 6 7 2 3 4 5
    whole = docs.across(every[None, :] <= head_and_tail[:, None], head_and_tail, every)
    assert whole.shape == (1, 1, 4, 8)
    assert whole[0, 0, 3].tolist() == [False, False, True, True, False, False, False, True]  # place 7: 6, 7, 5
    assert whole[0, 0, 1].tolist() == [True, True, False, False, False, False, False, False]  # place 1: 0, 1


def test_a_models_own_mask_is_taken_only_where_it_is_the_causal_mask_of_the_shares_positions() -> None:
    head_and_tail = shares(8, 2, 0)  # [0, 1, 6, 7]
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    assert means_causal(causal[None, None].expand(2, 1, 4, 4), head_and_tail)
    additive = torch.zeros(4, 4).masked_fill(~causal, torch.finfo(torch.float32).min)
    assert means_causal(additive, head_and_tail)
    assert means_causal(additive.masked_fill(~causal, -math.inf), head_and_tail)
    assert not means_causal(additive.masked_fill(~causal, -1.0), head_and_tail)  # a bias, not a mask
    cut = causal.clone()  # what transformers builds from these positions, uncached and unmasked: two "documents"
    cut[2:, :2] = False
    padded = causal.clone()
    padded[:, 0] = False
    for wrong in (cut, padded, torch.ones(4, 4, dtype=torch.bool)):
        assert not means_causal(wrong, head_and_tail)
    assert not means_causal(causal, shares(16, 2, 0))  # another share's length


def test_context_degrees_are_checked_with_their_arithmetic() -> None:
    assert dims_for("cp", 4).cp == 4 and dims_for("fsdp+cp", 4).sizes() == {
        "pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1}
    assert dims_for("fsdp+cp", 4).data_shard(1) == (0, 2)  # the two ranks of a cp group load the same rows
    with pytest.raises(ParatrainError, match="world 6 is not a multiple of tp 1 x pp 1 x cp 4 = 4"):
        dims_for("fsdp+cp", 6, cp_size=4)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("saved", "name"), [pytest.param("fsdp+cp", "llama", id="fsdp+cp"),
                                             pytest.param("cp+pp", "llama", id="cp+pp"),
                                             pytest.param("cp+pp", "rope-seq", id="cp+pp-rope-seq")])
def test_a_checkpoint_saved_with_shares_of_every_sequence_resumes_under_another_layout(saved: str, name: str,
                                                                                       tmp_path: Path) -> None:
    """Saved after one step of Llama (or the user RoPE decoder as an nn.Sequential) under `fsdp+cp 4` (weights
    sharded over dp_shard x cp) or `cp+pp 4` (each stage's layers on its ranks), resumed under `cp 2`: the rest of the
    epoch lands on the uninterrupted run's losses and weights."""
    import meta_cases

    first = paratrain("run", "--nproc", "4", "tests/moe_worker.py", saved, str(tmp_path / "a"), name,
                      timeout=240, env=cli_env(MOE_SAVE=str(tmp_path / "ck")))
    assert first.returncode == 0, first.stdout[-4000:]
    step = next((tmp_path / "ck").glob("step-*"))
    rest = paratrain("run", "--nproc", "2", "tests/moe_worker.py", "cp", str(tmp_path / "b"), name, timeout=240,
                     env=cli_env(MOE_RESUME=str(step)))
    assert rest.returncode == 0, rest.stdout[-4000:]
    with step_state.using(step_state.StepState()):
        ref, ref_losses = cases.plain(name)
    assert json.loads((tmp_path / "b" / "losses.json").read_text())[name] == pytest.approx(ref_losses[1:], abs=1e-5)
    got = meta_cases.read_export(str(tmp_path / "b" / name))
    worst = max((float((got[k] - ref[k]).abs().max()), k) for k in ref)
    assert worst[0] < 1e-5, f"{name} saved under {saved} 4, resumed under cp 2: {worst}"


def test_a_pipeline_with_cp_or_ep_inside_its_stages_takes_a_decoders_own_blocks_or_refuses() -> None:
    """Stages that hold expert or context parallelism are a transformers decoder's own blocks (`pipeline.blocks`)
    or the children of a user's nn.Sequential (under cp, given the positions where they take them): any other model
    would be traced, and a traced stage runs neither the dispatch nor attention over the shares."""
    from paratrain.parallel.context import Share
    from paratrain.parallel.pipeline.blocks import decoder_layers
    from paratrain.parallel.pipeline.partition import layers_of

    with pytest.raises(ParatrainError, match="RopeDecoder is not a decoder-only causal LM as transformers builds it.*"
                                             "an nn.Sequential of its blocks"):
        decoder_layers(cases.build("rope"), None)  # ep alone: a user model's own blocks as an nn.Sequential
    seq = cases.build("user-seq")
    assert [layer for _, layer in layers_of(seq, own_blocks=True)] == list(seq)  # called as themselves, no trace
    share = Share(None, 2, 0)
    with pytest.raises(ParatrainError, match=r"no child of the nn.Sequential \(0, 1, 2, 3, 4\) takes position_ids.*"
                                             "drop 'cp' or 'pp'"):
        layers_of(seq, own_blocks=True, share=share)  # cp: its position embedding would number each share from 0
    rope = cases.build("rope-seq")
    chain = layers_of(rope, own_blocks=True, share=share)
    assert [name for name, _ in chain] == ["0", "1", "2", "3", "4"]
    assert {n for _, layer in chain for n, _ in layer.named_parameters()} == {n for n, _ in rope.named_parameters()}
    chain = decoder_layers(cases.build("llama"), None)
    assert [name for name, _ in chain] == ["entry", "model.layers.0", "model.layers.1", "exit"]
    names = {n for _, layer in chain for n, _ in layer.named_parameters()}
    assert names == {n for n, _ in cases.build("llama").named_parameters()}  # the model's own names, each once
    aux = cases.build("mixtral-aux")
    with pytest.raises(ParatrainError, match="output_router_logits=True under a pipeline"):
        decoder_layers(aux, None)
