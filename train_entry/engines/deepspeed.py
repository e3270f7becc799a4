"""DeepSpeed ZeRO stages 0-3 with optional CPU/NVMe offload, bf16 or fp16.

The config was rendered on the login side (``task.json`` holds it). DeepSpeed runs
its own gradient accumulation: ``engine.step()`` is called after every micro-batch
and applies the optimizer only at the accumulation boundary.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

from .base import Engine, make_optimizer, set_lr


def _skip_unneeded_op_builds(device: torch.device) -> None:
    """On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory
    all-reduce op with g++ on first use (40-50 s per fresh machine); only inference
    uses it. Returning None is DeepSpeed's own path for "op not available"."""
    if device.type != "cpu":
        return
    importlib.import_module("deepspeed.comm")  # loads the module patched below
    # ``deepspeed.comm.torch`` as an attribute is the real torch; the module is in sys.modules
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def make_ds_optimizer(params, cfg: dict, on_gpu_with_offload: bool):
    """torch's optimizer everywhere (no compiled op to wait for), except that
    offloading from a GPU wants DeepSpeed's CPU Adam for its speed."""
    if on_gpu_with_offload and cfg["name"] == "adamw":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=cfg["lr"], betas=tuple(cfg["betas"]), weight_decay=cfg["weight_decay"], adamw_mode=True)
    return make_optimizer(params, cfg)


class DeepSpeedEngine(Engine):
    def __init__(self, cfg: dict, model: torch.nn.Module, device: torch.device):
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _skip_unneeded_op_builds(device)
        import deepspeed

        self.device = device
        ds_config = cfg["deepspeed_config"]
        zero = ds_config.get("zero_optimization", {})
        offload = "offload_optimizer" in zero or "offload_param" in zero
        model = model.to(device)
        optimizer = make_ds_optimizer([p for p in model.parameters() if p.requires_grad], cfg["optimizer"], device.type == "cuda" and offload)
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
        )

    def micro_step(self, inputs, targets, loss_fn, accum: int, last: bool) -> torch.Tensor:
        loss = loss_fn(self.model(inputs), targets)
        self.model.backward(loss)  # DeepSpeed scales by 1/accum and by the fp16 loss scale
        if not last:
            self.model.step()  # bookkeeping only: not an accumulation boundary
        return loss.detach().float()

    def optimizer_step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        self.model.step()  # the boundary: clip, step, zero the gradients
