from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn as nn

from orchestrator import contract
from train_entry.paramnames import clean


def forward(model: nn.Module, inputs: Any) -> Any:
    """A batch is a tensor (the built-in models) or keyword arguments (Hugging Face models)."""
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


class Engine:
    """The interface every engine implements."""

    device: torch.device
    model: nn.Module
    # frozen weights (LoRA's base) come from the model folder at every launch: not saved
    trainable_only: bool = False

    def micro_step(self, inputs: Any, targets: Any, loss_fn: Callable, accum: int, last: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns the detached, unscaled loss."""
        raise NotImplementedError

    def optimizer_step(self, lr: float) -> None:
        raise NotImplementedError

    def settle(self, inputs: Any, targets: Any, loss_fn: Callable) -> None:
        """Collective, before a resumed run loads its state: bring the engine to the layout an
        uninterrupted run has after its first step (a no-op where the layout never changes)."""

    state_format: str

    def save_state(self, folder, asynchronous: bool = False):
        """Collective: write this rank's shards under ``folder``; a future when asynchronous."""
        raise NotImplementedError

    def load_state(self, folder, same_world: bool) -> None:
        raise NotImplementedError


def make_optimizer(params, opt: contract.taskconfig.Optimizer) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]  # frozen weights (LoRA's base) have no state
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(params, lr=opt.lr, betas=tuple(opt.betas), weight_decay=opt.weight_decay)


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class DCPState:
    """Checkpoint state of the engines that own a torch model and optimizer (DDP, FSDP2),
    through torch.distributed.checkpoint: sharded, and loadable on any world size."""

    state_format = "dcp"
    _async_group = None
    _stager = None

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(ignore_frozen_params=self.trainable_only)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=opts)
        if self.trainable_only:  # a frozen weight tied to another (lm_head) is not named as frozen: keep by name
            keep = {clean(n) for n, p in self.model.named_parameters() if p.requires_grad}
            model_sd = {k: v for k, v in model_sd.items() if k in keep}
        return {"model": model_sd, "optim": optim_sd}

    def _share(self, state: dict) -> dict:
        """What this rank writes of ``state`` (engines whose ranks hold replicas write a share)."""
        return state

    def save_state(self, folder, asynchronous: bool = False):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        state, target = self._share(self._state()), str(folder / "dcp")
        # no fsync per file inside DCP: the commit has every rank flush every file while the
        # ranks hash them (checkpoint._hash_share), so the disk's flush and the hashing overlap
        writer = dcp.FileSystemWriter(target, sync_files=False)
        if not asynchronous:
            dcp.save(state, storage_writer=writer)
            return None
        if DCPState._async_group is None:  # the background writer must not share the training group
            DCPState._async_group = dist.new_group(backend="gloo")
        if self._stager is None:
            self._stager = _KeptStager(self.device.type == "cuda")
        # staging copies the state before async_save returns: that copy is the snapshot the
        # thread writes while training goes on updating the weights
        return dcp.async_save(state, storage_writer=writer, process_group=DCPState._async_group, async_stager=self._stager)

    def snapshot(self) -> dict | None:
        """The model's tensors in the copy the last asynchronous save writes (this rank's share)."""
        return self._stager.staged.get("model") if self._stager is not None and self._stager.staged else None

    def load_state(self, folder, same_world: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        from train_entry import safeload

        src = folder / "dcp"
        safeload.check_dcp(src)  # refused here, by name, before DCP reads a thing
        state = self._state()
        # readers that never unpickle beyond the allow-lists, whatever changed since the check
        dcp.load(state, storage_reader=safeload.SafeFileSystemReader(str(src)), planner=safeload.SafeLoadPlanner())
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=not self.trainable_only))


class _KeptStager:
    """DCP's staging, kept for the run: it reuses its copies (pinned on a GPU node) from one
    save to the next, where fresh ones cost page faults at every save; and it keeps the
    last copy, which the fingerprint of an asynchronous save is taken from."""

    def __init__(self, cuda: bool):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.inner = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                  use_async_staging=False, use_non_blocking_copy=False))
        self.staged: dict | None = None

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False  # stage() returns once the copy is made

    def stage(self, state_dict):
        self.staged = self.inner.stage(state_dict)
        return self.staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.inner.close()


class TorchOptimizerStep:
    """The optimizer step of the engines that own a torch optimizer (DDP, FSDP2)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    grad_clip: float | None

    def optimizer_step(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)  # DTensor-aware under FSDP2
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def layer_units(model: nn.Module, class_names: list[str] | None = None) -> list[nn.Module]:
    """The repeated blocks of a model: modules of the named classes, else those a Hugging
    Face model names as never to be split (``_no_split_modules``: its decoder layer), else
    the items of its ModuleLists (the transformer blocks of most models, ours included)."""
    if not class_names:
        for m in model.modules():
            if getattr(m, "_no_split_modules", None):
                class_names = list(m._no_split_modules)
                break
    if class_names:
        return [m for m in model.modules() if type(m).__name__ in class_names]
    units = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList):
            units.extend(m)
    return units


def apply_activation_checkpointing(model: nn.Module, units: list[nn.Module]) -> None:
    """Recompute each unit in backward instead of keeping its activations (non-reentrant,
    which works under DDP, FSDP2 and DeepSpeed alike)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing as apply,
        checkpoint_wrapper,
    )

    ids = {id(u) for u in units}
    apply(
        model,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: id(m) in ids,
    )


def autocast(device: torch.device, precision: str):
    """bf16 compute with fp32 weights (DDP's mixed precision)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
