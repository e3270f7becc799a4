"""A fingerprint of a model's trainable parameters that does not depend on how they are
sharded: recorded in a checkpoint's manifest when it is committed, and checked after
every resume or reshard, before the first step (a resume that silently re-initialised a
layer, or weights altered after the commit, is caught here instead of trained on).

Each parameter is seen as one flat vector ``x`` of its global shape. Three sums, in
float64, make its fingerprint: ``sum(x_i * w_i)`` with a fixed weight per global index
``w_i = 1 + frac(i * golden ratio)`` (so a permutation or a swapped row shows), ``sum(x_i²)``
and ``sum(|x_i|)`` (the scale the tolerance is taken from). A rank adds up only the
elements it holds — an FSDP2 shard (DTensor, by its global offset), a ZeRO-3 partition
(by its flat offset), or its slice of a tensor every rank holds whole (a DDP or ZeRO-1/2
replica; a DTensor of another layout, gathered first), so that the work is split — and the
sums are all-reduced: any world size and any engine give the same numbers, up to float64
rounding. An asynchronous DDP save takes them from the copy its writer writes instead, each
rank summing the parameters whole in its share of it (``partial``, then ``finish`` at the
commit).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from orchestrator import contract

from train_entry.errors import UserCodeError
from train_entry.paramnames import clean

METHOD = "flatsum-v1"
RTOL = 1e-6  # float64 sums in another order differ by ~1e-12 relative; a changed tensor by far more
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
_CHUNK = 1 << 18  # elements per pass: four float64 buffers of at most a chunk (2 MiB each: in cache)


def _slice(flat: torch.Tensor, rank: int, world: int) -> Iterator[tuple[int, torch.Tensor]]:
    """This rank's share of a tensor every rank holds whole."""
    lo, hi = flat.numel() * rank // world, flat.numel() * (rank + 1) // world
    if hi > lo:
        yield lo, flat[lo:hi]


def _pieces(p: torch.Tensor, rank: int, world: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(flat offset, flat values) of the elements of ``p`` this rank counts."""
    ds_tensor = getattr(p, "ds_tensor", None)
    if ds_tensor is not None:  # ZeRO-3: rank r holds [r * part, (r + 1) * part) of the padded flat tensor
        group = getattr(p, "ds_process_group", None)
        r = dist.get_rank(group=group) if group is not None else rank
        part = ds_tensor.ds_numel if hasattr(ds_tensor, "ds_numel") else ds_tensor.numel()
        start = r * part
        n = max(0, min(part, p.ds_numel - start))
        if n:
            yield start, ds_tensor.detach().reshape(-1)[:n]
        return
    to_local = getattr(p, "to_local", None)
    if to_local is not None:  # a DTensor (FSDP2)
        from torch.distributed.tensor import Shard

        if all(isinstance(pl, Shard) and pl.dim == 0 for pl in p.placements):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local_shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            row = math.prod(p.shape[1:]) if p.dim() > 1 else 1
            local = to_local().detach().reshape(-1)
            if local.numel():
                yield offset[0] * row if p.dim() else 0, local
            return
        yield from _slice(p.full_tensor().detach().reshape(-1), rank, world)  # another layout: gathered
        return
    yield from _slice(p.detach().reshape(-1), rank, world)  # a replica


class _Sums:
    """The three sums of flat pieces, chunk by chunk, through float64 buffers kept for one
    fingerprint (fresh tensors per chunk cost more in page faults than the sums)."""

    def __init__(self) -> None:
        self.size = 0

    def _buffers(self, n: int) -> None:
        if n > self.size:  # grown by doubling as pieces get larger, never past a chunk
            n = self.size = min(max(n, 2 * self.size), _CHUNK)
            # frac(j * golden): a chunk starting at i weighs element j by 1 + frac(frac(i * golden) + that)
            self.base = torch.frac(torch.arange(n, dtype=torch.float64) * _GOLDEN)
            self.x, self.w, self.floor = (torch.empty(n, dtype=torch.float64) for _ in range(3))

    def __call__(self, offset: int, values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(3, dtype=torch.float64)
        for s in range(0, values.numel(), _CHUNK):
            piece = values[s : s + _CHUNK]
            n = piece.numel()
            self._buffers(n)
            x, w, floor = self.x[:n], self.w[:n], self.floor[:n]
            x.copy_(piece)  # to the CPU, in float64
            torch.add(self.base[:n], math.modf((offset + s) * _GOLDEN)[0], out=w)
            torch.floor(w, out=floor)
            w.sub_(floor).add_(1.0)  # 1 + frac(i * golden)
            out += torch.stack([torch.dot(x, w), torch.dot(x, x), torch.linalg.vector_norm(x, 1)])
        return out


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", 0) or p.numel())


def _covered(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters a fingerprint covers (the trainable ones), by name, in its order."""
    return sorted(((clean(n), p) for n, p in model.named_parameters() if p.requires_grad), key=lambda np: np[0])


def trainable(model: nn.Module) -> list[tuple[str, int]]:
    """(name, number of elements) of the parameters a fingerprint covers, in its order."""
    return [(n, _numel(p)) for n, p in _covered(model)]


def compute(model: nn.Module) -> dict:
    """Collective (every rank, same model): the fingerprint of ``model``'s trainable
    parameters, as JSON: ``{"method", "params": {name: [weighted, sum_sq, sum_abs, numel]}}``."""
    named = _covered(model)
    distributed = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    sums = torch.zeros(len(named), 3, dtype=torch.float64)
    add_up = _Sums()
    for i, (_, p) in enumerate(named):
        for offset, values in _pieces(p, rank, world):
            sums[i] += add_up(offset, values)
    return finish(sums, [(n, _numel(p)) for n, p in named])


def partial(tensors: dict, names: list[tuple[str, int]]) -> torch.Tensor:
    """Not collective: the sums of the parameters whole in ``tensors`` (a rank's share of a
    snapshot, by name), with a fourth column counting them; zeros for the others.
    ``finish`` adds up every rank's."""
    sums = torch.zeros(len(names), 4, dtype=torch.float64)
    add_up = _Sums()
    for i, (name, numel) in enumerate(names):
        t = tensors.get(name)
        if isinstance(t, torch.Tensor) and t.numel() == numel:
            sums[i, :3] = add_up(0, t.detach().reshape(-1)) if numel else 0.0
            sums[i, 3] = 1.0
    return sums


class Incomplete(RuntimeError):
    """The ranks' partial sums did not cover every parameter exactly once, or a rank failed."""


def finish(sums: torch.Tensor, names: list[tuple[str, int]], failed: bool = False) -> dict:
    """Collective: every rank's sums added up, as the fingerprint's JSON. Sums from
    ``partial`` (four columns) must count each parameter once over the ranks; ``failed``
    (this rank could not make its sums) makes every rank raise ``Incomplete``, none left
    waiting in the all-reduce."""
    flag = torch.zeros(1, sums.shape[1], dtype=torch.float64)
    flag[0, 0] = 1.0 if failed else 0.0
    both = torch.cat([sums.to(torch.float64), flag])
    if dist.is_available() and dist.is_initialized():
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # nccl reduces device tensors only
        moved = both.to(device)
        dist.all_reduce(moved)
        both = moved.cpu()
    sums, failures = both[:-1], int(both[-1, 0].item())
    if failures:
        raise Incomplete(f"{failures} rank(s) could not take their part of the fingerprint")
    if sums.shape[1] == 4 and not bool((sums[:, 3] == 1.0).all()):
        counted = {n: int(c) for (n, _), c in zip(names, sums[:, 3].tolist()) if c != 1.0}
        raise Incomplete(f"parameters not counted exactly once over the ranks: {dict(list(counted.items())[:5])}")
    return {"method": METHOD, "params": {n: [*map(float, sums[i, :3].tolist()), numel] for i, (n, numel) in enumerate(names)}}


def _problems(expected: dict, got: dict, rtol: float) -> list[tuple[str, str]]:
    """(parameter name, what differs) for each parameter that does not match."""
    want, have = expected["params"], got["params"]
    problems = [(n, f"{n} is not in the loaded model") for n in sorted(set(want) - set(have))]
    problems += [(n, f"{n} is trainable now but not in the checkpoint") for n in sorted(set(have) - set(want))]
    for name in sorted(set(want) & set(have)):
        w, h = want[name], have[name]
        if not (isinstance(w, list) and len(w) == 4 and all(isinstance(v, (int, float)) for v in w)):
            problems.append((name, f"{name}: the checkpoint's fingerprint is malformed"))
        elif int(w[3]) != int(h[3]):
            problems.append((name, f"{name} has {int(h[3])} elements, the checkpoint {int(w[3])}"))
        elif not (abs(w[0] - h[0]) <= 2 * rtol * max(w[2], h[2]) + 1e-30 and abs(w[1] - h[1]) <= rtol * max(w[1], h[1]) + 1e-30):
            # written so that a NaN anywhere is a mismatch
            problems.append((name, f"{name} differs (sum of squares {h[1]:.6g}, the checkpoint's {w[1]:.6g})"))
    return problems


def _readable(expected: dict) -> bool:
    return isinstance(expected, dict) and expected.get("method") == METHOD and isinstance(expected.get("params"), dict)


def mismatched(expected: dict, got: dict, rtol: float = RTOL) -> list[str]:
    """Pure: the names of the parameters that do not match (all of them for an unreadable record)."""
    if not _readable(expected):
        return sorted(got["params"])
    return [n for n, _ in _problems(expected, got, rtol)]


def compare(expected: dict, got: dict, rtol: float = RTOL) -> str | None:
    """Pure: None when ``got`` matches ``expected``, else what differs (the first few names)."""
    if not _readable(expected):
        return "the checkpoint's fingerprint is not one this version reads"
    problems = [why for _, why in _problems(expected, got, rtol)]
    if not problems:
        return None
    shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    return f"{len(problems)} of {len(expected['params'])} parameters do not match the checkpoint's fingerprint: {shown}"


class ResumeMismatch(UserCodeError):
    """The state loaded for a resume is not the state that was committed: weights altered
    after the commit, a layer re-initialised by the loading code, another model. Resuming
    again would load the same thing, so it is not retried; the run stops and says why."""


def recorded(folder: str | Path) -> dict | None:
    """The fingerprint a committed checkpoint's manifest holds (None: an older checkpoint, or
    a script that records none)."""
    found = contract.read_manifest(folder).get("fingerprint")
    return found if isinstance(found, dict) else None


def check_resume(folder: str | Path, model: nn.Module) -> None:
    """Collective, after the load and before the first step: raise ResumeMismatch when the
    loaded trainable parameters differ from the fingerprint ``folder``'s manifest records."""
    expected = recorded(folder)
    if expected is None:
        return
    problem = compare(expected, compute(model))
    if problem is not None:
        raise ResumeMismatch(f"the state resumed is not the one saved: {problem}; not training on from it ({folder})")
