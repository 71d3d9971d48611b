"""Streamed, sharded and packed data under prepare_loader: the map-style guarantees, measured.

Tier 1 builds each replica's loader as a worker builds it (no process group): the global batches of 1, 2
and 3 replicas are equal, every sample comes once per epoch, num_workers=2 equals 0, a position saved
under 2 replicas resumes under 3, for every format, Hugging Face streaming datasets (with .map, .filter,
.shuffle and a user's batched packer) and paratrain's own packing; bad input is refused naming the file.
Tier 3 trains a tiny model with `python` (one process) and 2 and 3 workers on a streamed jsonl dataset,
with and without packing, and stops under 2 workers to resume under 3: the same weights to 1e-6.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import max_diff
from torch.utils.data import DataLoader, IterableDataset

import paratrain
from paratrain import ParatrainError, ShardedLoader
from paratrain.data import document_mask, jsonl, pack

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the tests write their datasets; nothing is downloaded

SEED, LR, TOL = 5, 0.1, 1e-6
SIZES = (9, 14, 7, 11, 10)  # 51 samples in 5 shards: global batch 12 leaves a tail of 3 (2 | 1, 1 | 1 | 1)


# -- data the tests write ------------------------------------------------------------------------------
def records(n: int = sum(SIZES)) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(n, 8, generator=g), torch.randn(n, 2, generator=g)
    return [{"id": i, "x": x[i].tolist(), "y": y[i].tolist(), "tokens": [(i * 7 + k) % 29 for k in range(i % 6 + 2)]}
            for i in range(n)]


def write_jsonl(folder: Path, sizes: tuple[int, ...] = SIZES) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    rows, files, start = records(sum(sizes)), [], 0
    for j, size in enumerate(sizes):
        path = folder / f"part-{j:03d}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows[start : start + size]))
        files.append(str(path))
        start += size
    return files


def write_other_formats(folder: Path) -> dict[str, list[str]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows, out = records(), {"parquet": [], "arrow": [], "webdataset": []}
    for j, lo in enumerate(range(0, len(rows), 20)):
        table = pa.Table.from_pylist(rows[lo : lo + 20])
        pq.write_table(table, folder / f"p{j}.parquet", row_group_size=6)
        with pa.OSFile(str(folder / f"a{j}.arrow"), "wb") as f:  # one IPC file, one IPC stream (datasets' layout)
            writer = (pa.ipc.new_file if j % 2 else pa.ipc.new_stream)(f, table.schema)
            writer.write_table(table)
            writer.close()
        with tarfile.open(folder / f"w{j}.tar", "w") as tar:
            for r in rows[lo : lo + 20]:
                for ext, data in (("json", json.dumps(r).encode()), ("cls", str(r["id"]).encode())):
                    info = tarfile.TarInfo(f"{r['id']:05d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        out["parquet"].append(str(folder / f"p{j}.parquet"))
        out["arrow"].append(str(folder / f"a{j}.arrow"))
        out["webdataset"].append(str(folder / f"w{j}.tar"))
    return out


def ids(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """collate_fn: the sample ids of a batch."""
    return {"id": torch.tensor([b["id"] if "id" in b else b["json"]["id"] for b in batch])}


# -- tier 1: each replica's loader, built as a worker builds it -------------------------------------------
def loaders(make: Any, global_batch: int, replicas: int, workers: int = 0, collate: Any = ids,
            drop_last: bool = False) -> list[ShardedLoader]:
    return [ShardedLoader(DataLoader(make(), batch_size=global_batch // replicas, num_workers=workers,
                                     collate_fn=collate, drop_last=drop_last), r, replicas, seed=SEED)
            for r in range(replicas)]


def steps(prepared: list[ShardedLoader], limit: int | None = None, field: str = "id") -> list[list[Any]]:
    """One pass (the rest of the current epoch, or `limit` steps): each step's global batch (the replicas'
    shares joined in replica order) of `field` rows."""
    its = [iter(p) for p in prepared]
    out: list[list[Any]] = []
    while limit is None or len(out) < limit:
        shares = [next(it, None) for it in its]
        if shares[0] is None:
            assert all(s is None for s in shares), "replicas must run the same number of steps"
            return out
        out.append(sum((s[field].tolist() for s in shares), []))
    return out


def epochs(make: Any, replicas: int, n: int = 2, **kw: Any) -> list[list[list[int]]]:
    prepared = loaders(make, 12, replicas, **kw)
    return [steps(prepared) for _ in range(n)]


def test_formats_read_the_same_samples_in_order_and_by_position(tmp_path: Path) -> None:
    from paratrain.data import arrow, parquet, webdataset
    from paratrain.data.indexed import StreamView, describe

    files = write_other_formats(tmp_path)
    want = records()
    for stream in (jsonl(write_jsonl(tmp_path / "j")), parquet(files["parquet"]), arrow(files["arrow"]),
                   webdataset(files["webdataset"], transform=lambda s: s["json"])):
        assert list(stream) == want, stream.source.format  # the plain stream, shard after shard
        view = StreamView(stream.source, describe(stream.source, 0, None), 0)
        assert len(view) == len(want)
        picked = [37, 3, 50, 0, 20, 19]
        assert view.__getitems__(picked) == [want[i] for i in picked]  # the prepared loader's way: by position
    tar = webdataset(files["webdataset"][:1])
    assert next(iter(tar)) == {"__key__": "00000", "json": want[0], "cls": 0}


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "arrow", "webdataset"])
def test_same_global_batches_on_1_2_3_replicas_every_sample_once_per_epoch(tmp_path: Path, fmt: str) -> None:
    from paratrain import data

    files = {"jsonl": write_jsonl(tmp_path)} if fmt == "jsonl" else write_other_formats(tmp_path)
    make = lambda: getattr(data, fmt)(files[fmt], shuffle=True)  # noqa: E731
    one = epochs(make, 1)
    assert epochs(make, 2) == epochs(make, 3) == one
    for epoch in one:
        assert sorted(sum(epoch, [])) == list(range(51))  # every sample once
        assert [len(b) for b in epoch] == [12, 12, 12, 12, 3]  # the short last batch kept
    assert one[0] != one[1]  # a new order each epoch
    plain = epochs(lambda: getattr(data, fmt)(files[fmt]), 2, n=1)[0]
    assert sum(plain, []) == list(range(51))  # unshuffled: the files' order


def test_shuffle_keeps_shards_together_and_draws_a_new_shard_order_each_epoch(tmp_path: Path) -> None:
    files = write_jsonl(tmp_path)
    starts = [0, 9, 23, 30, 41, 51]
    shard_of = {i: j for j in range(5) for i in range(starts[j], starts[j + 1])}
    orders = [sum(e, []) for e in epochs(lambda: jsonl(files, shuffle=True), 1, n=3)]
    runs = [[shard_of[i] for k, i in enumerate(o) if k == 0 or shard_of[o[k - 1]] != shard_of[i]] for o in orders]
    assert all(sorted(r) == list(range(5)) for r in runs)  # each shard's rows come together
    assert len({tuple(r) for r in runs}) > 1


def test_loader_workers_change_nothing(tmp_path: Path) -> None:
    files = write_jsonl(tmp_path)
    make = lambda: jsonl(files, shuffle=True)  # noqa: E731
    assert epochs(make, 2, workers=2) == epochs(make, 2)


def test_position_saved_under_2_replicas_resumes_under_3(tmp_path: Path) -> None:
    files = write_jsonl(tmp_path)
    make = lambda: jsonl(files, shuffle=True)  # noqa: E731
    whole = epochs(make, 1)
    two = loaders(make, 12, 2)
    first = steps(two, limit=3)
    state = two[0].state_dict()
    assert state["consumed"] == 36 and [s[0] for s in state["shards"]] == files
    three = loaders(make, 12, 3)
    for p in three:
        p.load_state_dict(state)
    assert first + steps(three) == whole[0]
    assert steps(three) == whole[1]


# -- Hugging Face datasets --------------------------------------------------------------------------------
def hf_stream(files: list[str], kind: str, tmp: Path, shuffle: bool = True) -> Any:
    import datasets

    ds = datasets.load_dataset(kind, data_files=files, split="train", streaming=True, cache_dir=str(tmp / "hf"))
    ds = ds.map(lambda e: {"length": len(e["tokens"])}).filter(lambda e: e["id"] % 5 != 3)
    return ds.shuffle(seed=1, buffer_size=4) if shuffle else ds


@pytest.mark.parametrize("kind", ["json", "parquet"])
def test_hugging_face_streaming_with_map_filter_shuffle(tmp_path: Path, kind: str) -> None:
    files = write_jsonl(tmp_path) if kind == "json" else write_other_formats(tmp_path)["parquet"]
    make = lambda: hf_stream(files, kind, tmp_path)  # noqa: E731
    one = epochs(make, 1)
    kept = [i for i in range(51) if i % 5 != 3]
    for epoch in one:
        assert sorted(sum(epoch, [])) == kept
    assert epochs(make, 2, workers=2) == epochs(make, 3) == one
    assert one[0] != one[1]
    unshuffled = epochs(lambda: hf_stream(files, kind, tmp_path, shuffle=False), 2, n=1)[0]
    assert sum(unshuffled, []) == kept


def packer(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """A user's batched .map packer: the batch's token lists joined and cut into rows of 8."""
    flat = [t for doc in batch["tokens"] for t in doc]
    rows = [flat[i : i + 8] for i in range(0, len(flat) - 7, 8)]
    return {"input_ids": rows}


def tokens_of(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.stack([torch.as_tensor(b["input_ids"]) for b in batch])}


def test_a_users_batched_map_packer_on_hugging_face_streaming(tmp_path: Path) -> None:
    import datasets

    files = write_jsonl(tmp_path)

    def make() -> Any:
        ds = datasets.load_dataset("json", data_files=files, split="train", streaming=True,
                                   cache_dir=str(tmp_path / "hf"))
        return ds.map(packer, batched=True, batch_size=5, remove_columns=["id", "x", "y", "tokens"]).shuffle(
            seed=0, buffer_size=3)

    def epochs_rows(replicas: int, workers: int = 0) -> list[list[list[tuple[int, ...]]]]:
        prepared = loaders(make, 4, replicas, workers=workers, collate=tokens_of, drop_last=True)
        return [[[tuple(r) for r in b] for b in steps(prepared, field="input_ids")] for _ in range(2)]

    one = epochs_rows(1)
    assert epochs_rows(2) == epochs_rows(4, workers=2) == one
    docs = [[json.loads(line)["tokens"] for line in Path(f).read_text().splitlines()] for f in files]
    every = [tuple(r) for d in docs for k in range(0, len(d), 5) for r in packer({"tokens": d[k : k + 5]})["input_ids"]]
    got = [r for b in one[0] for r in b]  # the packer ran on each shard from its first document, batches of 5
    assert len(got) == len(every) // 4 * 4 and set(got) <= set(every) and len(set(got)) == len(got)
    assert one[0] != one[1]  # reshuffled: the epoch's order is paratrain's


# -- paratrain's packing ------------------------------------------------------------------------------------
def test_pack_concatenates_documents_with_their_boundaries(tmp_path: Path) -> None:
    files = write_jsonl(tmp_path)
    seqs = list(pack(jsonl(files[:1]), 6, key="tokens"))
    docs = [r["tokens"] for r in records()[:9]]
    flat = [t for d in docs for t in d]
    assert [s["input_ids"].tolist() for s in seqs] == [flat[i : i + 6] for i in range(0, len(flat) // 6 * 6, 6)]
    first = seqs[0]  # documents of 2 and 3 tokens, then the first of the third
    assert first["position_ids"].tolist() == [0, 1, 0, 1, 2, 0]
    assert first["document_ids"].tolist() == [0, 0, 1, 1, 1, 2]
    mask = document_mask(first["document_ids"][None])[0]
    assert mask[4].tolist() == [False, False, True, True, True, False]
    padded = list(pack(jsonl(files[:1]), 5, key="tokens", pad=-100))  # 36 tokens: 7 sequences and 1 token
    assert len(padded) == 8 and padded[-1]["input_ids"].tolist() == [flat[-1]] + [-100] * 4
    assert padded[-1]["document_ids"].tolist() == [0, -1, -1, -1, -1]
    make = lambda: pack(jsonl(files, shuffle=True), 6, key="tokens")  # noqa: E731
    one = steps(loaders(make, 6, 1, collate=None), field="input_ids")  # 35 sequences: 5 x 6 and a tail of 5
    assert steps(loaders(make, 6, 2, workers=2, collate=None), field="input_ids") == one
    assert steps(loaders(make, 6, 3, collate=None), field="input_ids") == one
    every = [seq["input_ids"].tolist() for seq in make()]  # the packed stream, read plainly
    assert sorted(sum(one, [])) == sorted(every) and sum(one, []) != every  # each sequence once, shuffled


# -- bad input -----------------------------------------------------------------------------------------------
class Plain(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


class Listed(IterableDataset):
    """The protocol: shards, read_shard, shard_length (here deliberately wrong for shard 'b')."""

    shards = ["a", "b"]

    def __init__(self, *, length: bool = True, reader: bool = True) -> None:
        if not length:
            self.shard_length = None  # type: ignore[assignment]
        if not reader:
            self.read_shard = None  # type: ignore[assignment]

    def read_shard(self, shard: str) -> Iterator[dict[str, int]]:
        return iter([{"id": i} for i in range(4 if shard == "a" else 6)])

    def shard_length(self, shard: str) -> int:
        return 4 if shard == "a" else 5

    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("paratrain reads the shards itself")


def test_a_stream_without_a_shard_list_or_reader_is_refused_with_the_fix() -> None:
    with pytest.raises(ParatrainError, match="without a shard list.*read_shard"):
        loaders(Plain, 4, 1)
    with pytest.raises(ParatrainError, match="no read_shard"):
        ShardedLoader(DataLoader(Listed(reader=False), batch_size=2), 0, 1, seed=0)


def test_a_protocol_stream_is_ordered_and_a_wrong_length_named() -> None:
    counted = Listed(length=False)  # no shard_length: counted by reading
    counted.shard_length = None  # type: ignore[assignment]
    prepared = loaders(lambda: counted, 4, 2)
    assert sum(steps(prepared), []) == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]  # unshuffled: shard a, then b
    wrong = loaders(Listed, 4, 1)  # shard 'b' says 5 and yields 6
    with pytest.raises(ParatrainError, match="shard b now holds 6 samples but held 5"):
        steps(wrong)


def test_a_shard_that_disappears_or_is_truncated_between_epochs_is_named(tmp_path: Path) -> None:
    files = write_jsonl(tmp_path)
    prepared = loaders(lambda: jsonl(files, shuffle=True), 12, 2)
    steps(prepared)
    text = Path(files[2]).read_text()
    Path(files[2]).write_text(text[: len(text) // 2])
    with pytest.raises(ParatrainError, match=f"shard file {files[2]} is .* bytes before epoch 1 but was"):
        steps(prepared)
    Path(files[2]).unlink()
    fresh = loaders(lambda: jsonl(files[:2] + files[3:]), 12, 1)
    Path(files[0]).unlink()
    with pytest.raises(ParatrainError, match=f"shard file {files[0]} disappeared"):
        steps(fresh)


def test_a_resume_over_changed_shards_is_refused_naming_the_file(tmp_path: Path) -> None:
    files = write_jsonl(tmp_path)
    prepared = loaders(lambda: jsonl(files, shuffle=True), 12, 2)
    steps(prepared, limit=2)
    state = prepared[0].state_dict()
    with pytest.raises(ParatrainError, match=f"read shard {files[4]}, which this loader lacks"):
        loaders(lambda: jsonl(files[:4], shuffle=True), 12, 3)[0].load_state_dict(state)
    with open(files[1], "a") as f:
        f.write(json.dumps(records(52)[51]) + "\n")
    with pytest.raises(ParatrainError, match=f"shard {files[1]} had 14 samples .* has 15"):
        loaders(lambda: jsonl(files, shuffle=True), 12, 3)[0].load_state_dict(state)


def test_other_refusals_name_the_fix(tmp_path: Path) -> None:
    import gzip

    import datasets
    from datasets.distributed import split_dataset_by_node

    files = write_jsonl(tmp_path)
    ds = datasets.load_dataset("json", data_files=files, split="train", streaming=True, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ParatrainError, match="split_dataset_by_node"):
        loaders(lambda: split_dataset_by_node(ds, rank=0, world_size=2), 4, 1)
    from paratrain.data import webdataset

    tar = write_other_formats(tmp_path)["webdataset"][0]
    Path(tar + ".gz").write_bytes(gzip.compress(Path(tar).read_bytes()))
    with pytest.raises(ParatrainError, match="compressed tar"):
        loaders(lambda: webdataset([tar + ".gz"]), 4, 1)
    with pytest.raises(ParatrainError, match="not found"):
        jsonl([str(tmp_path / "missing.jsonl")])


# -- tier 3: python vs 2 vs 3 workers, and a resume from 2 workers under 3 -------------------------------
def train(folder: str, packed: bool, ckpt: str | None = None, stop: int | None = None,
          workers: int = 0) -> dict[str, Any]:
    """A user's script: a streamed jsonl dataset (packed into sequences of 6 tokens or not), global batch 12
    (6 sequences, the short last batch dropped, for packed), a tiny model, SGD with momentum, 2 epochs. With
    `stop` it saves after that many steps and returns; with a checkpoint present it resumes from it."""
    run = paratrain.setup(seed=SEED, checkpoint_dir=ckpt)
    files = sorted(str(p) for p in Path(folder).glob("*.jsonl"))
    stream = pack(jsonl(files, shuffle=True), 6, key="tokens") if packed else jsonl(files, shuffle=True)
    batch = 6 if packed else 12
    loader = run.prepare_loader(DataLoader(stream, batch_size=run.per_worker_batch(batch), num_workers=workers,
                                           collate_fn=None if packed else _xy, drop_last=packed))
    torch.manual_seed(SEED)
    model: torch.nn.Module = TinyLM() if packed else torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                                                          torch.nn.Linear(16, 2))
    model, opt = run.prepare(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    state = {"model": model, "optimizer": opt, "loader": loader, "step": 0}
    if ckpt:
        run.load(state)
    seen: list[tuple[int, list[int]]] = []
    for epoch in range(loader.epoch, 2):
        for b in loader:
            if packed:
                loss = run.forward_backward(model, b, b["input_ids"], TinyLM.loss)
                seen.append((epoch, b["input_ids"][:, 0].tolist()))
            else:
                seen.append((epoch, b["id"].tolist()))
                loss = run.forward_backward(model, b["x"], b["y"], torch.nn.functional.mse_loss)
            opt.step()
            opt.zero_grad()
            state["step"] += 1
            if stop is not None and state["step"] == stop:
                run.save(state)
                run.close()
                return {"seen": seen}
    weights = {k: v.detach().clone() for k, v in run.unwrap(model).state_dict().items()}
    run.close()
    return {"weights": weights, "seen": seen, "loss": float(loss)}


def _xy(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"id": torch.tensor([b["id"] for b in batch]), "x": torch.tensor([b["x"] for b in batch]),
            "y": torch.tensor([b["y"] for b in batch])}


class TinyLM(torch.nn.Module):
    """Next-token prediction that reads the packed sequence's positions (document boundaries)."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.out = torch.nn.Embedding(29, 8), torch.nn.Embedding(6, 8), torch.nn.Linear(8, 29)

    def forward(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.out(self.tok(b["input_ids"]) + self.pos(b["position_ids"]))  # type: ignore[no-any-return]

    @staticmethod
    def loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 29), ids[:, 1:].reshape(-1))


def cases(folder: str, ckpt: str, stop: int | None, resume: bool) -> dict[str, Any]:
    out = {"plain": train(folder, False, workers=2 if stop else 0), "packed": train(folder, True)}
    if stop is not None:
        out["first"] = train(folder, False, ckpt=ckpt, stop=stop)
    if resume:
        out["rest"] = train(folder, False, ckpt=ckpt)
    return out


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_python_2_and_3_workers_reach_the_same_weights_and_resume_across_world_sizes(tmp_path: Path) -> None:
    folder, ckpt = str(tmp_path / "data"), str(tmp_path / "ckpt")
    write_jsonl(Path(folder))
    one = cases(folder, ckpt="", stop=None, resume=False)
    two = paratrain.launch(cases, folder, ckpt, 3, False, nproc=2, timeout=120, all_ranks=True)
    three = paratrain.launch(cases, folder, ckpt, None, True, nproc=3, timeout=120, all_ranks=True)
    for name in ("plain", "packed"):
        for res in two + three:
            assert max_diff(res[name]["weights"], one[name]["weights"]) < TOL, name
    for world in (two, three):  # every sample once per epoch over all ranks, in the same global batches
        for epoch in (0, 1):
            rows = [i for res in world for e, b in res["plain"]["seen"] if e == epoch for i in b]
            assert sorted(rows) == list(range(51))
    for res in three:
        assert max_diff(res["rest"]["weights"], one["plain"]["weights"]) < TOL  # 3 steps under 2, the rest under 3
    resumed = [i for res in two for _, b in res["first"]["seen"] for i in b] + \
              [i for res in three for e, b in res["rest"]["seen"] if e == 0 for i in b]
    assert sorted(resumed) == list(range(51))
