"""One rank: a Hugging Face model folder loaded for FSDP2 (built empty, sharded, each rank
reading its rows) or ZeRO-3 (built partitioned, each rank reading its flat piece) through the
trainer's own load and engine; rank 0 writes every parameter gathered whole, and each rank
what it holds (tests/multiproc/test_hf_weights.py compares them with the unsharded load).

    python sharded_load.py MODEL_DIR OUT_DIR LORA(0|1) KIND    (RANK, WORLD_SIZE, MASTER_* set)
KIND: full, hybrid (FSDP2 sharding) or zero3.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from orchestrator import contract
from train_entry.engines import build_engine
from train_entry.hf import load
from train_entry.paramnames import clean

folder, out, lora, sharding = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
dist.init_process_group("gloo")
world = dist.get_world_size()
zero3 = sharding == "zero3"
engine = {"kind": "deepspeed" if zero3 else "fsdp", "backend": "gloo", "precision": "fp32", "find_unused_parameters": False,
          "activation_checkpointing": True, "sharding": "full" if zero3 else sharding, "cpu_offload": False, "wrap": None}
ds = None
if zero3:
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
          "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
    engine.update(stage=3, offload_optimizer=None, offload_param=None)
mcfg = {"path": folder, "dtype": "fp32", "attn_implementation": "eager", "qlora": None, "gguf_file": None,
        "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]} if lora else None}
raw = {"contract": contract.CONTRACT_VERSION, "experiment_id": "w", "index": 0, "steps": 1, "task_dir": out,
       "engine": engine, "optimizer": {"name": "adamw", "lr": 1e-3, "grad_clip": None},
       "resources": {"tasks_per_node": 1 if sharding == "hybrid" else world}}
if ds:
    raw["deepspeed_config"] = ds
loaded = load.load_model(mcfg, 7, ds, engine)
params_meta = all(p.is_meta or hasattr(p, "ds_tensor") for n, p in loaded.model.named_parameters() if "lora_" not in n)
wrapped = build_engine(contract.TaskConfig.from_dict(raw), loaded.model, torch.device("cpu"), fill=loaded.fill).model
if zero3:
    import deepspeed

    module = wrapped.module
    local = {clean(n): [p.ds_tensor.numel()] for n, p in module.named_parameters()}
    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        whole = {clean(n): p.detach().clone().contiguous() for n, p in module.named_parameters()}
else:
    whole = {clean(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone().contiguous()
             for n, p in wrapped.named_parameters()}
    local = {clean(n): list(p.to_local().shape) for n, p in wrapped.named_parameters() if hasattr(p, "to_local")}
buffers = {clean(n): b.tolist() for n, b in wrapped.named_buffers()}
if dist.get_rank() == 0:
    from safetensors.torch import save_file

    save_file(whole, os.path.join(out, "whole.safetensors"))
contract.atomic_write_json(os.path.join(out, f"rank{dist.get_rank()}.json"),
                           {"how": loaded.how, "built_empty": params_meta, "local_shapes": local, "buffers": buffers})
dist.destroy_process_group()
print(json.dumps({"ok": True}))
