"""A resume that proves itself: what a commit records, and the check after every load.

At a commit the built-in trainer records in the manifest (besides the files):
``fingerprint`` (of the trainable parameters as saved: ``fingerprint.compute`` before the
write, or, for an asynchronous DDP save, ``fingerprint.partial`` of the copy its writer
writes, on a thread while training moves on, added up at the commit), ``loss`` (the step's loss, as logged)
and ``probe``: the loss of the NEXT step's first micro-batch on every rank, computed
forward-only. The data is a pure function of (seed, step, micro-batch, rank) and the
probe runs in the model's current train/eval mode under a forked RNG with the buffers put
back, so it is exactly what the resumed run's first micro-batch computes, and the run it
was taken from goes on bit for bit as if it had never run.

After the load, before the first step, every rank recomputes both: the fingerprint, and
the probe of each saved rank's micro-batch with that rank's saved RNG state (so a reshard
checks the same data and dropout masks). Equal world size: the losses must be bitwise
equal; another world size: within ``RESHARD_RTOL``. A mismatch is a ``checkpoint.mismatch``
event and ``ResumeMismatch`` (a user error: resuming again would load the same thing).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import distributed as dist

from orchestrator import contract
from train_entry.checkpoint import fingerprint, rng
from train_entry.checkpoint.fingerprint import ResumeMismatch
from train_entry.engines.base import autocast, forward

# relative difference of the probe loss allowed on a reshard; measured 0 (bitwise) for DDP,
# FSDP2 and ZeRO-2/3 with 2 -> 1 and 2 -> 4 ranks (tests/multiproc/test_resume_fingerprint.py), kept
# above float32 rounding so a kernel that sums in another order never fails a good resume
RESHARD_RTOL = 1e-5


def _reduce_device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"  # nccl alone reduces device tensors only


@contextmanager
def untouched(model: torch.nn.Module, device: torch.device, grad: bool = False):
    """Nothing done inside stays: torch's and Python's RNG streams (dropout, a dataset's
    augmentation) forked, buffers (a BatchNorm's running statistics) copied back, and no
    graph unless ``grad`` (the probe here; the DDP settle before a resume takes one)."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    py_state = random.getstate()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []), \
            torch.set_grad_enabled(grad):
        try:
            yield
        finally:
            random.setstate(py_state)
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)


def probe_loss(engine, inputs, targets, loss_fn) -> float:
    """The loss ``engine.micro_step`` would compute for this batch, with no step taken.
    Collective under FSDP and ZeRO-3 (a forward gathers the parameters)."""
    with autocast(engine.device, getattr(engine, "precision", "fp32")):
        return float(loss_fn(forward(engine.model, inputs), targets).detach().float())


def _gather_floats(values: list[float], count: int) -> list[list[float]]:
    """Every rank's ``count`` floats (float64 keeps a float32 loss exact)."""
    mine = torch.tensor(values, dtype=torch.float64, device=_reduce_device())
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.cpu().tolist() for t in out]


def settings_of(cfg: contract.TaskConfig) -> str:
    """What the loss depends on besides the weights and the data order: the model and data
    sections and the precision. A resume under other settings has no loss to compare."""
    what = {"model": cfg.to_dict()["model"], "data": cfg.to_dict()["data"], "precision": cfg.engine.get("precision")}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def next_step_probe(engine, dataset, loss_fn, sampler, step: int, cfg: contract.TaskConfig) -> dict:
    """Collective, at a save of ``step``: every rank's loss on its first micro-batch of the
    step after it, as the resumed run will compute it (the batch is made inside the fork:
    a dataset that draws random numbers draws the same ones again)."""
    with untouched(engine.model, engine.device):
        inputs, targets = sampler.batch(dataset, step, 0, engine.device)
        loss = probe_loss(engine, inputs, targets, loss_fn)
    losses = [r[0] for r in _gather_floats([loss], 1)]
    return {"step": step, "world_size": sampler.world, "micro_batch": sampler.mb, "grad_accum": sampler.accum,
            "seed": sampler.seed, "dataset_len": sampler.n, "engine": cfg.engine["kind"], "settings": settings_of(cfg),
            "losses": losses}


def step_loss(losses: list) -> float:
    """Collective: the step's loss as the metrics log it (mean of the micro-batches, over ranks)."""
    loss = torch.stack(losses).mean().float().to(_reduce_device())
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    return float(loss)


def reprobe(engine, dataset, loss_fn, folder: Path, probe: dict) -> list[float]:
    """Collective, after the load: the probe of every saved rank's micro-batch, recomputed.
    The saved ranks are shared round-robin; every rank runs the same number of forwards
    (FSDP and ZeRO-3 gather in each), a rank with none left repeats one and drops it."""
    from train_entry.data import Sampler

    rank, world, saved = dist.get_rank(), dist.get_world_size(), probe["world_size"]
    rounds = math.ceil(saved / world)
    mine = []
    for i in range(rounds):
        r = i * world + rank
        src = r if r < saved else rank % saved
        sampler = Sampler(probe["dataset_len"], probe["seed"], probe["micro_batch"], probe["grad_accum"], saved, src)
        with untouched(engine.model, engine.device):
            rng.use_saved_torch_streams(folder, src, engine.device)
            inputs, targets = sampler.batch(dataset, probe["step"], 0, engine.device)
            loss = probe_loss(engine, inputs, targets, loss_fn)
        mine.append(loss if r < saved else math.nan)
    got = [math.nan] * saved
    for r_world, values in enumerate(_gather_floats(mine, rounds)):
        for i, v in enumerate(values):
            if i * world + r_world < saved:
                got[i * world + r_world] = v
    return got


def _fingerprint_distance(expected: dict, got: dict) -> float:
    """The largest relative difference of the sums of squares (0.0: equal to the last bit)."""
    worst = 0.0
    for name, w in expected["params"].items():
        h = got["params"].get(name)
        if h is not None:
            worst = max(worst, abs(w[1] - h[1]) / max(abs(w[1]), 1e-30))
    return worst


def _check_fingerprint(folder: Path, model, checked: list, problems: list, fields: dict) -> None:
    """Collective: the loaded trainable parameters against the recorded fingerprint."""
    expected = fingerprint.recorded(folder)
    if expected is None:
        checked.append("no fingerprint recorded (an older checkpoint)")
        return
    got = fingerprint.compute(model)
    problem = fingerprint.compare(expected, got)
    if problem:
        problems.append(problem)
        fields["parameters"] = fingerprint.mismatched(expected, got)
        return
    distance = _fingerprint_distance(expected, got)
    checked.append(f"the fingerprint of {len(got['params'])} trainable parameters matches "
                   f"(largest relative difference {distance:.1e})")
    fields["fingerprint_rel_diff"] = distance


def _check_probe(folder: Path, probe, engine, dataset, loss_fn, cfg: contract.TaskConfig, checked: list, problems: list,
                 fields: dict) -> None:
    """Collective: the first micro-batch's loss, recomputed, against the one recorded."""
    if not isinstance(probe, dict):
        checked.append("no loss recorded to compare (an older checkpoint)")
        return
    unusable = _probe_unusable(probe, len(dataset), settings_of(cfg))
    if unusable is not None:
        checked.append(f"no loss check: {unusable}")
        return
    got = reprobe(engine, dataset, loss_fn, folder, probe)
    want = [float(v) for v in probe["losses"]]
    world = dist.get_world_size()
    exact = probe["world_size"] == world and probe.get("engine") == cfg.engine["kind"]
    rtol = 0.0 if exact else RESHARD_RTOL
    diff = max(abs(g - w) / max(abs(w), 1e-30) for g, w in zip(got, want))
    fields.update(expected_losses=want, losses=got, loss_rel_diff=diff)
    how = ("bitwise, same world size" if exact else
           f"relative tolerance {rtol:g}, {probe.get('engine')} on {probe['world_size']} -> {cfg.engine['kind']} on {world} ranks")
    said = f"the first micro-batch's loss of step {probe['step'] + 1} is {_fmt(got)}, recorded {_fmt(want)}"
    if diff <= rtol:
        checked.append(f"{said} ({how}; largest relative difference {diff:.1e})")
    else:  # NaN lands here too
        problems.append(f"{said} (relative difference {diff:.2e}; {how})")


def _conclude(folder: Path, step: int, checked: list, problems: list, fields: dict, hb) -> None:
    if problems:
        # what is wrong first, the folder last: `status` shows a reason cut to its column
        cause = (f"the state resumed from step {step} is not the one saved: " + "; ".join(problems)
                 + f"; stopped instead of training on from it ({folder})")
        hb.event("checkpoint.mismatch", cause, **fields)
        raise ResumeMismatch(cause)
    if "fingerprint_rel_diff" in fields or "loss_rel_diff" in fields:  # an older checkpoint proves nothing: no event
        hb.event("checkpoint.verified", f"resumed state of step {step}: " + "; ".join(checked), **fields)


def verify(folder: Path, engine, dataset, loss_fn, hb, cfg: contract.TaskConfig) -> None:
    """Collective, after the load and before the first step: the loaded state against what
    the manifest recorded. An event either way; ResumeMismatch on a mismatch."""
    manifest = contract.read_manifest(folder)
    checked, problems, fields = [], [], {"step": manifest["step"]}
    _check_fingerprint(folder, engine.model, checked, problems, fields)
    if not problems:  # a wrong state gives a wrong loss too: the parameters' names say more
        _check_probe(folder, manifest.get("probe"), engine, dataset, loss_fn, cfg, checked, problems, fields)
    _conclude(folder, manifest["step"], checked, problems, fields, hb)


def verify_fingerprint(folder: Path, model, hb) -> None:
    """Collective: ``verify`` without the loss (a script's own loop: its data is its own)."""
    step = contract.read_manifest(folder)["step"]
    checked, problems, fields = [], [], {"step": step}
    _check_fingerprint(folder, model, checked, problems, fields)
    _conclude(folder, step, checked, problems, fields, hb)


def _fmt(losses: list[float]) -> str:
    return "[" + ", ".join(f"{v:.9g}" for v in losses) + "]"


def _probe_unusable(probe: dict, dataset_len: int, settings: str) -> str | None:
    """Why a recorded probe cannot be recomputed (None: it can)."""
    keys = {"step": int, "world_size": int, "micro_batch": int, "grad_accum": int, "seed": int, "dataset_len": int, "losses": list}
    if any(not isinstance(probe.get(k), t) for k, t in keys.items()) or len(probe["losses"]) != probe["world_size"]:
        return "the checkpoint's probe record is malformed"
    if probe["dataset_len"] != dataset_len:
        return f"the dataset has {dataset_len} samples, the checkpoint's run had {probe['dataset_len']}"
    if probe.get("settings") != settings:
        return "the model, data or precision settings are not those of the checkpoint's run"
    return None

