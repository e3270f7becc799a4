"""DistributedDataParallel: full replicas, gradients all-reduced in buckets."""

from __future__ import annotations

import contextlib

import torch
from torch import distributed as dist
from torch.nn.parallel import DistributedDataParallel

from orchestrator import contract

from train_entry.paramnames import clean
from train_entry.engines.base import DCPState, Engine, TorchOptimizerStep, autocast, forward, make_optimizer


class DDPEngine(DCPState, TorchOptimizerStep, Engine):
    fingerprint_from_copy = True  # an async save's copy holds its share's tensors whole (_share)

    def __init__(self, cfg: contract.TaskConfig, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.precision = cfg.engine["precision"]
        model = model.to(device)
        ids = [device.index] if device.type == "cuda" else None
        # every rank loaded the frozen weights from the same folder: nothing to broadcast or reduce
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        if frozen:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
        self.model = DistributedDataParallel(
            model,
            device_ids=ids,
            find_unused_parameters=cfg.engine["find_unused_parameters"],
            gradient_as_bucket_view=True,  # no second copy of the gradients
        )
        self.optimizer = make_optimizer(self.model.parameters(), cfg.optimizer)
        self.grad_clip = cfg.optimizer.grad_clip

    def micro_step(self, inputs, targets, loss_fn, accum: int, last: bool) -> torch.Tensor:
        # skip the gradient all-reduce on all but the last micro-batch of a step
        ctx = contextlib.nullcontext() if last else self.model.no_sync()
        self.before_forward()
        with ctx:
            with autocast(self.device, self.precision):
                loss = loss_fn(forward(self.model, inputs), targets)
            (loss / accum).backward()
        return loss.detach().float()

    def _share(self, state: dict) -> dict:
        # every rank holds the whole state: each writes (and, when asynchronous, copies) only
        # its share, whole tensors balanced by size, the same split on every rank; DCP's
        # metadata is the union, so any rank loads any of it
        model, optim = state["model"], state["optim"]
        self.saved_model_keys = set(model)
        # buffers (running statistics) from rank 0: DDP's next forward broadcasts rank 0's
        buffers = {clean(n) for n, _ in self.model.named_buffers()}
        mine = {("model", k) for k in model if k in buffers} if dist.get_rank() == 0 else set()
        units = [(("model", k), v.numel() * v.element_size()) for k, v in model.items() if isinstance(v, torch.Tensor) and k not in buffers]
        units += [(("optim", k), sum(t.numel() * t.element_size() for t in v.values() if isinstance(t, torch.Tensor)))
                  for k, v in optim.get("state", {}).items()]
        load = [0] * dist.get_world_size()
        for unit, size in sorted(units, key=lambda u: (-u[1], u[0])):
            r = load.index(min(load))
            load[r] += size
            if r == dist.get_rank():
                mine.add(unit)
        share = {
            "model": {k: v for k, v in model.items() if ("model", k) in mine or not isinstance(v, torch.Tensor)},
            "optim": {**optim, "state": {k: v for k, v in optim.get("state", {}).items() if ("optim", k) in mine}},
        }
        return share

    def settle(self, inputs, targets, loss_fn) -> None:
        # DDP lays its gradient buckets out again after the first backward, in the order the
        # gradients came. An all-reduce sums each element in an order set by its place in the
        # bucket (the ring's chunks), so a resumed run's first step, made with the first
        # layout, would round differently from the uninterrupted run's (one ulp, more ranks
        # than two). One discarded backward gives the layout: no optimizer step, gradients
        # dropped (worker.settle keeps buffers and random streams as they were). Two ranks
        # need none: each element is the sum of two addends, the same in either order, and a
        # backward of a large model costs a restart as much as a step.
        if dist.get_world_size() <= 2:
            return
        self.micro_step(inputs, targets, loss_fn, accum=1, last=True)
        self.optimizer.zero_grad(set_to_none=True)
