"""What the readers and the writers share: the error type and ``Item``, one output tensor
as planned before any tensor is read (a streamed safetensors header needs every shape,
dtype and size up front)."""

from __future__ import annotations

import math
from dataclasses import dataclass


class ConsolidateError(Exception):
    """A checkpoint or output that cannot be consolidated; the message names the file."""


@dataclass(frozen=True)
class Item:
    name: str  # in the output
    key: str  # in the reader
    shape: tuple[int, ...]
    nbytes: int  # in the output dtype
    dtype: object = None  # the output's torch dtype


def make_item(name: str, key: str, shape, stored, out) -> Item:
    dt = out_dtype(stored, out)
    return Item(name, key, tuple(shape), numel(shape) * dt.itemsize, dt)


def numel(shape) -> int:
    return math.prod(int(d) for d in shape)


def out_dtype(stored, out):
    """Floating tensors become ``out``; integer and bool buffers keep their dtype."""
    return out if stored.is_floating_point else stored
