"""FSDP2 (``fully_shard``): each repeated block, then the root, sharded over a device mesh.

``full`` reshards parameters after forward (ZeRO-3-like); ``shard_grad_op`` keeps
them gathered until backward is done (ZeRO-2-like); ``hybrid`` shards within a node
and replicates across nodes (a 2-D mesh, replicate x shard).
"""

from __future__ import annotations

import torch
from torch import distributed as dist

from orchestrator import contract

from train_entry.engines.base import DCPState, Engine, TorchOptimizerStep, forward, layer_units, make_optimizer


def device_mesh(device: torch.device, sharding: str, per_node: int):
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if sharding == "hybrid":
        return init_device_mesh(device.type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))


class FSDPEngine(DCPState, TorchOptimizerStep, Engine):
    def __init__(self, cfg: contract.TaskConfig, model: torch.nn.Module, device: torch.device, fill=None):
        """``fill(model, device)``: given for a model built on the meta device; called once it is sharded."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        e = cfg.engine
        self.device = device
        mesh = device_mesh(device, e["sharding"], cfg.resources.tasks_per_node)
        kw = dict(
            mesh=mesh,
            reshard_after_forward=e["sharding"] != "shard_grad_op",
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if e["precision"] == "bf16"
            else MixedPrecisionPolicy(),
            offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if e["cpu_offload"] else OffloadPolicy(),
        )
        if not e["cpu_offload"] and fill is None:
            model = model.to(device)
        for unit in layer_units(model, e["wrap"]):
            fully_shard(unit, **kw)
        fully_shard(model, **kw)
        if fill is not None:
            fill(model, torch.device("cpu") if e["cpu_offload"] else device)
        self.model = model
        self.optimizer = make_optimizer(model.parameters(), cfg.optimizer)
        self.grad_clip = cfg.optimizer.grad_clip

    def micro_step(self, inputs, targets, loss_fn, accum: int, last: bool) -> torch.Tensor:
        # reduce-scatter gradients only on the last micro-batch of a step
        self.model.set_requires_gradient_sync(last)
        self.before_forward()
        loss = loss_fn(forward(self.model, inputs), targets)
        (loss / accum).backward()
        return loss.detach().float()
