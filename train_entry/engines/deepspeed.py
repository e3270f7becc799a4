"""DeepSpeed ZeRO stages 0-3 with optional CPU/NVMe offload, bf16 or fp16.

The config was rendered on the login side (``task.json`` holds it). DeepSpeed runs
its own gradient accumulation: ``engine.step()`` is called after every micro-batch
and applies the optimizer only at the accumulation boundary.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import torch

from orchestrator import contract

from orchestrator.contract import thaw
from train_entry.engines.base import Engine, forward, make_optimizer, set_lr


def skip_unneeded_op_builds(device: torch.device) -> None:
    """On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory
    all-reduce op with g++ on first use (40-50 s per fresh machine); only inference
    uses it. Returning None is DeepSpeed's own path for "op not available"."""
    if device.type != "cpu":
        return
    importlib.import_module("deepspeed.comm")  # loads the module patched below
    # ``deepspeed.comm.torch`` as an attribute is the real torch; the module is in sys.modules
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def make_ds_optimizer(params, opt: contract.taskconfig.Optimizer, on_gpu_with_offload: bool):
    """torch's optimizer everywhere (no compiled op to wait for), except that
    offloading from a GPU wants DeepSpeed's CPU Adam for its speed."""
    if on_gpu_with_offload and opt.name == "adamw":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(params, lr=opt.lr, betas=tuple(opt.betas), weight_decay=opt.weight_decay, adamw_mode=True)
    return make_optimizer(params, opt)


UNIVERSAL_TIMEOUT_S = 3600
TAG = "state"


class DeepSpeedEngine(Engine):
    state_format = "deepspeed"

    def __init__(self, cfg: contract.TaskConfig, model: torch.nn.Module, device: torch.device, resume=None):
        if device.type == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        skip_unneeded_op_builds(device)
        import deepspeed

        self.device = device
        ds_config = thaw(cfg.deepspeed_config)  # a dict of its own: DeepSpeed changes what it is given
        self.task_dir = cfg.dir
        self.stage = ds_config.get("zero_optimization", {}).get("stage", 0)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # another world size: DeepSpeed loads only its universal format, chosen at initialize
        self.universal = bool(resume and resume.folder and resume.world_size not in (None, world))
        if self.universal:
            ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
        zero = ds_config.get("zero_optimization", {})
        offload = "offload_optimizer" in zero or "offload_param" in zero
        model = model.to(device)
        optimizer = make_ds_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optimizer, device.type == "cuda" and offload)
        self.model, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=ds_config, dist_init_required=False
        )

    def micro_step(self, inputs, targets, loss_fn, accum: int, last: bool) -> torch.Tensor:
        loss = loss_fn(forward(self.model, inputs), targets)
        self.model.backward(loss)  # DeepSpeed scales by 1/accum and by the fp16 loss scale
        if not last:
            self.model.step()  # bookkeeping only: not an accumulation boundary
        return loss.detach().float()

    def optimizer_step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        self.model.step()  # the boundary: clip, step, zero the gradients

    # ------------------------------------------------------------ checkpoints

    def _trainable_module_state(self, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
        """DeepSpeed's module_state_dict, of the trainable parameters only, without asking every
        module for its state: a 4-bit base (QLoRA) cannot give one while ZeRO-3 partitions it,
        and the frozen base comes from the model folder at every launch anyway."""
        return OrderedDict(
            (prefix + n, p if keep_vars else p.detach()) for n, p in self.model.module.named_parameters() if p.requires_grad
        )

    def save_state(self, folder, asynchronous: bool = False):
        if self.trainable_only:
            self.model.module_state_dict = self._trainable_module_state
        # save_latest=False: DeepSpeed's `latest` pointer is written by rank 0 alone and not
        # atomically; our manifest is what marks a checkpoint complete.
        self.model.save_checkpoint(str(Path(folder) / "deepspeed"), tag=TAG, save_latest=False,
                                   exclude_frozen_parameters=self.trainable_only)
        return None

    def load_state(self, folder, same_world: bool) -> None:
        from train_entry.checkpoint import safeload

        # DeepSpeed (and its universal conversion) unpickles with weights_only=False: every file it
        # may read passes the weights-only loader first, on every rank, or nothing is loaded
        src = Path(folder) / "deepspeed"
        safeload.check_everywhere(src, safeload.torch_files(src))
        if self.universal:
            src = self._universal(Path(folder))
            safeload.check_everywhere(src, safeload.torch_files(src))
            self.model.load_checkpoint(str(src), tag=TAG, load_lr_scheduler_states=False, load_module_strict=not self.trainable_only)
            return
        self.model.load_checkpoint(str(src), tag=TAG, load_optimizer_states=True, load_lr_scheduler_states=False,
                                   load_module_strict=not self.trainable_only)

    def _universal(self, folder: Path) -> Path:
        """DeepSpeed's universal checkpoint of ``folder`` (converted once, by rank 0, into
        this task's checkpoints folder; a half-made conversion is never used)."""
        from torch import distributed as dist

        out = contract.checkpoints_dir(self.task_dir) / f".universal-{folder.name}-{hashlib.sha1(str(folder).encode()).hexdigest()[:8]}"
        if dist.get_rank() == 0 and not (out / TAG).is_dir():
            tmp = out.with_name(out.name + ".tmp")
            _remove(tmp)
            argv = [
                sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                "--input_folder", str(folder / "deepspeed" / TAG), "--output_folder", str(tmp / TAG),
            ]
            if self.stage < 3:
                argv.append("--inject_missing_state")
            subprocess.run(argv, check=True, timeout=UNIVERSAL_TIMEOUT_S, stdout=sys.stdout, stderr=sys.stderr)
            _remove(out)
            os.replace(tmp, out)
        dist.barrier()
        return out


def _remove(path: Path) -> None:
    """A conversion folder of our checkpoints folder, never through a symbolic link (contract.deletion_problem)."""
    if path.is_symlink():
        path.unlink()  # the link, not what it points to
    elif contract.deletion_problem(path) is None:
        shutil.rmtree(path, ignore_errors=True)
