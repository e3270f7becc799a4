"""GPU only (marked ``gpu``; skipped without CUDA; ``scripts/gpu-check`` runs them on the
lent device): a DDP engine on CUDA under bf16 autocast keeps fp32 master weights; its
asynchronous save stages the state into pinned host memory, and the checkpoint, loaded onto
a fresh engine on the device, holds exactly the weights of the step saved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from orchestrator import contract

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]


def _cfg(task_dir: Path) -> contract.TaskConfig:
    return contract.TaskConfig.from_dict({
        "contract": contract.CONTRACT_VERSION, "experiment_id": "g", "index": 0, "steps": 10, "task_dir": str(task_dir),
        "checkpoint": {"every_steps": 1, "keep_last": 2, "async_save": True, "direct_io": True},
        "engine": {"kind": "ddp", "backend": "gloo", "precision": "bf16", "find_unused_parameters": False,
                   "activation_checkpointing": False},
        "optimizer": {"name": "adamw", "lr": 1e-2, "grad_clip": None}})


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))


def _step(engine, device) -> torch.Tensor:
    loss = engine.micro_step(torch.randn(4, 256, device=device), None, lambda out, _t: out.pow(2).mean(), 1, True)
    engine.optimizer_step(1e-2)
    return loss


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    elif isinstance(tree, torch.Tensor):
        yield tree


def test_bf16_on_cuda_keeps_fp32_master_weights_and_an_async_save_is_pinned_and_exact(tmp_path, world_of_one):
    from train_entry.checkpoint.checkpointer import Checkpointer
    from train_entry.engines import build_engine

    device = torch.device("cuda", 0)
    cfg = _cfg(tmp_path)
    engine = build_engine(cfg, _model(), device)
    loss = _step(engine, device)
    assert torch.isfinite(loss)
    assert {p.device.type for p in engine.model.parameters()} == {"cuda"}
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}  # autocast computes in bf16, keeps fp32

    saved = {k: v.detach().clone() for k, v in engine.model.module.state_dict().items()}
    ck = Checkpointer(cfg, 0, 1, engine)
    assert ck.save(1, {})["async"]
    staged = list(_leaves(engine.snapshot().result(timeout=120)))
    assert staged and all(t.device.type == "cpu" and t.is_pinned() for t in staged)  # host copies, pinned
    _step(engine, device)  # waits for the copy, then changes the weights
    ck.finish_pending()
    ck.close()

    fresh = build_engine(cfg, _model(), device)
    Checkpointer(cfg, 0, 1, fresh).load(ck.find_resume())
    loaded = fresh.model.module.state_dict()
    for name, tensor in saved.items():
        assert loaded[name].device.type == "cuda"
        assert torch.equal(loaded[name], tensor), name
