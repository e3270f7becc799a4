"""Test workloads importable by trainers as `faulty:...` (tests put this folder on PYTHONPATH)."""

import torch


class _Boom(torch.nn.Module):
    def __init__(self, at: int):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.calls = 0
        self.at = at

    def forward(self, x):
        self.calls += 1
        if self.calls >= self.at:
            raise ValueError(f"user bug at forward call {self.calls}")
        return self.lin(x)


class _Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, generator=g)
        return x, x.sum(dim=0, keepdim=True)


def raises_at(at: int = 3):
    """A model that raises in its forward pass from call ``at`` on."""
    return {"model": _Boom(at), "dataset": _Pairs(), "loss": torch.nn.functional.mse_loss}


def regression():
    """A small well-behaved regression workload."""
    return {"model": torch.nn.Linear(4, 1), "dataset": _Pairs(), "loss": torch.nn.functional.mse_loss}
