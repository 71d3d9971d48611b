"""Image classification on synthetic data: a small ConvNet with BatchNorm, the tutorials' full DDP
recipe (sharded loader, SyncBatchNorm, AMP, all-reduced validation accuracy, rank-0 checkpoints) in
paratrain's few lines, with a progress bar and per-step logs (metrics.jsonl and TensorBoard).

    python examples/image_classification.py --epochs 1
    paratrain run --nproc 2 examples/image_classification.py --checkpoint-dir /tmp/ckpt --profile
    tensorboard --logdir /tmp/ckpt/logs
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain


def synthetic_images(n: int, classes: int, size: int, seed: int) -> TensorDataset:
    """Class-dependent blobs plus noise, so accuracy rises above chance as training works."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    prototypes = torch.randn(classes, 3, size, size, generator=torch.Generator().manual_seed(99))
    images = prototypes[labels] + 0.8 * torch.randn(n, 3, size, size, generator=g)
    return TensorDataset(images, labels)


def convnet(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, classes),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--precision", default="32")
    parser.add_argument("--batchnorm", choices=("exact", "local"), default="exact",
                        help="exact: the global batch's statistics, as one process (all-reduced on GPUs and CPU "
                             "workers alike); local: each worker's own rows, DistributedDataParallel's default")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--log-dir", default=None, help="default: <checkpoint-dir>/logs, else runs/<date>-<time>")
    parser.add_argument("--progress", action="store_true", default=None,
                        help="show the progress bar even when stderr is not a terminal")
    parser.add_argument("--profile", action="store_true", help="log where each step's time goes, per rank")
    args = parser.parse_args()

    run = paratrain.setup(strategy=args.strategy, precision=args.precision, batchnorm=args.batchnorm,
                          checkpoint_dir=args.checkpoint_dir, log_dir=args.log_dir, progress=args.progress,
                          profile=args.profile, seed=0)
    batch = run.per_worker_batch(args.global_batch)
    train = run.prepare_loader(DataLoader(synthetic_images(512, 10, 16, seed=1), batch_size=batch, shuffle=True))
    val = run.prepare_loader(DataLoader(synthetic_images(200, 10, 16, seed=2), batch_size=batch), evaluation=True)
    model = convnet(10)
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    state = {"model": model, "optimizer": optimizer, "loader": train, "epoch": 0, "step": 0}
    if args.checkpoint_dir:
        run.load(state)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(train.epoch, args.epochs):
        model.train()
        for images, labels in train:
            optimizer.zero_grad()
            loss = loss_fn(model(images.to(run.device)), labels.to(run.device))
            run.backward(loss)
            optimizer.step()
            state["step"] += 1
            run.log(state["step"], loss=loss, total_steps=args.epochs * len(train))  # mean over ranks
        model.eval()
        correct = torch.zeros((), device=run.device)
        seen = torch.zeros((), device=run.device)
        with torch.no_grad():
            for images, labels in val:
                predicted = run.unwrap(model)(images.to(run.device)).argmax(dim=1)
                correct += (predicted == labels.to(run.device)).sum()
                seen += len(labels)
        accuracy = run.all_reduce(correct, "sum") / run.all_reduce(seen, "sum")
        run.log(state["step"], {"val/accuracy": accuracy})
        run.print(f"epoch {epoch} train loss {loss.item():.4f} val accuracy {accuracy.item():.3f} "
                  f"on {int(run.all_reduce(seen, 'sum').item())} images")
        state["epoch"] = epoch + 1
        if args.checkpoint_dir:
            run.save(state)
    run.close()


if __name__ == "__main__":
    main()
