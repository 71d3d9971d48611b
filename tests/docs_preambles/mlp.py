"""A small regression model, its optimizer and dataset, built before the block's `setup`."""

import torch
from torch.utils.data import DataLoader, TensorDataset  # noqa: F401 (the block uses DataLoader)

import paratrain  # noqa: F401 (the block calls paratrain.setup)

torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 20), torch.randn(256, 1))
model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss_fn = torch.nn.functional.mse_loss
epochs = 1
