from __future__ import annotations

import contextlib
import time
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
    # the files the last save_state wrote, hashed as written (checkpoint.writer.Written), if any
    written = None

    def save_state(self, folder, asynchronous: bool = False):
        """Collective: write this rank's shards under ``folder``; a future when asynchronous."""
        raise NotImplementedError

    def load_state(self, folder, same_world: bool) -> None:
        raise NotImplementedError

    def wait_staged(self) -> None:
        """Before the saved state changes: an asynchronous save's copy of it is made."""

    def before_forward(self) -> None:
        """Before a forward: the same, where a forward changes saved state (running statistics)."""


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

    direct_io = True  # checkpoint.direct_io (build_engine sets it from the task config)

    def save_state(self, folder, asynchronous: bool = False):
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from train_entry.checkpoint.writer import HashingWriter

        self.wait_staged()  # a save's copy is never made over the last one's while it is made
        state, target = self._share(self._state()), str(folder / "dcp")
        # hashed as written and flushed by the rank that wrote it: the commit reads nothing back
        writer = HashingWriter(target, asynchronous, direct=self.direct_io)
        self.written = writer.written
        if not asynchronous:
            dcp.save(state, storage_writer=writer)
            return None
        if DCPState._async_group is None:  # the background writer must not share the training group
            DCPState._async_group = dist.new_group(backend="gloo")
        if self._stager is None:
            self._stager = _KeptStager(self.device)
        # a tensor of the state that is not a parameter (a running statistic) may change in
        # the next forward; parameters and optimizer states only at the next optimizer step
        params = {clean(n) for n, _ in self.model.named_parameters(remove_duplicate=False)}  # a tied weight under each name
        self._staged_before_forward = any(isinstance(v, torch.Tensor) and k not in params for k, v in state["model"].items())
        # the copy is made on a thread while the next forward and backward run; it must be done
        # before anything it copies changes (``wait_staged``); the writer writes from it
        response = dcp.async_save(state, storage_writer=writer, process_group=DCPState._async_group, async_stager=self._stager)
        return response.upload_completion

    def wait_staged(self) -> None:
        """Before the state changes: wait for an asynchronous save's copy of it (the time is
        training blocked by that save: ``staging_wait_s``)."""
        if self._stager is not None:
            self.staging_wait_s += self._stager.wait()

    staging_wait_s = 0.0
    _staged_before_forward = False

    def before_forward(self) -> None:
        if self._staged_before_forward:
            self.wait_staged()

    def snapshot(self):
        """A future of the copy the last asynchronous save writes (this rank's share), or None."""
        return self._stager.copy if self._stager is not None else None

    def load_state(self, folder, same_world: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        from train_entry.checkpoint import safeload

        src = folder / "dcp"
        safeload.check_dcp(src)  # refused here, by name, before DCP reads a thing
        state = self._state()
        # readers that never unpickle beyond the allow-lists, whatever changed since the check
        dcp.load(state, storage_reader=safeload.SafeFileSystemReader(str(src)), planner=safeload.SafeLoadPlanner())
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=not self.trainable_only))


class _KeptStager:
    """DCP's staging, kept for the run and run on a thread of its own. Kept: it reuses its
    copies (pinned on a GPU node) from one save to the next, where fresh ones cost page
    faults at every save; and it keeps the last copy, which the fingerprint of an
    asynchronous save is taken from. On a thread: the copy is made while the next forward
    and backward run, and training waits for it only before it changes what is copied."""

    def __init__(self, device: torch.device):
        from concurrent.futures import ThreadPoolExecutor

        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = device.type == "cuda"
        self.inner = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                  use_async_staging=False, use_non_blocking_copy=False))
        # a new thread's current device is GPU 0: this rank's own, or it would open a context there
        init = {"initializer": torch.cuda.set_device, "initargs": (device,)} if cuda else {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-staging", **init)
        self.copy = None  # a future of the last copy
        self.waiting = None  # the copy training has not waited for yet

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict):
        self.copy = self.waiting = self.pool.submit(self.inner.stage, state_dict)
        return self.copy  # DCP's writer waits for it on its own thread

    def wait(self) -> float:
        """Seconds waited for the last copy (its error, if it failed, is raised here)."""
        if self.waiting is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            self.waiting.result()
        finally:
            self.waiting = None
        return time.perf_counter() - t0

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.inner.close()


class TorchOptimizerStep:
    """The optimizer step of the engines that own a torch optimizer (DDP, FSDP2)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    grad_clip: float | None

    def optimizer_step(self, lr: float) -> None:
        self.wait_staged()  # an asynchronous save's copy of the weights and states is made
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
