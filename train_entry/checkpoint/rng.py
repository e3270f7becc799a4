"""Every rank's RNG states in a checkpoint (``rng/rank-N.pt``): torch's, CUDA's where it is
in use, and Python's. Plain tensors and ints: they load with ``weights_only=True`` and no
allow-list, and a resumed run draws the numbers the saved one would have drawn.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import torch

from train_entry.checkpoint import safeload

RNG_DIR = "rng"


def rng_file(folder: Path, rank: int) -> Path:
    return folder / RNG_DIR / f"rank-{rank}.pt"


def _current() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rng_state(folder: Path, rank: int) -> None:
    torch.save(_current(), rng_file(folder, rank))


def _read(path: Path) -> dict:
    return safeload.torch_load(path, mmap=False, allow={})


def load_rng_state(path: Path) -> None:
    """This rank's RNG states from ``path``, read with ``weights_only=True`` and no allow-list."""
    state = _read(path)
    try:
        _set(state)
    except (TypeError, KeyError, ValueError, RuntimeError) as exc:
        raise safeload.CheckpointRefused(f"{path}: not RNG states ({exc})") from None


def restore(folder: Path, rank: int) -> None:
    """This rank's states as saved in ``folder``; a rank that did not exist in the saved run
    keeps its seeded state."""
    path = rng_file(folder, rank)
    if os.path.lexists(path):
        load_rng_state(path)


def use_saved_torch_streams(folder: Path, rank: int, device: torch.device) -> None:
    """Inside a forked RNG: the torch streams saved rank ``rank`` had at the save (its dropout)."""
    path = rng_file(folder, rank)
    if not os.path.lexists(path):
        return
    state = _read(path)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
