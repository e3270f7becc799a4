"""Your own DeepSpeed training loop under orchestrate (run by configs/byo.yaml).

orchestrate starts this script on every rank with the torchrun variables set, renders
the DeepSpeed config from the spec (batch sizes checked, stage, precision, clipping),
and through `train_entry.client` gives the loop heartbeats, the preemption / time-limit
signal agreed by all ranks, and checkpoints that count only once committed.
"""

import os

import deepspeed
import torch
import torch.nn.functional as F
from torch import nn

from train_entry import client

if os.environ.get("ORCHESTRATE_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
torch.distributed.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
run = client.init()
cfg = run.config  # the task's typed config (orchestrator.contract.TaskConfig): cfg.steps, cfg.optimizer.lr

torch.manual_seed(cfg.seed)
model = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=run.deepspeed_config)


def batch(step: int, micro: int):
    """The data of (step, micro-batch, rank): a pure function, so resuming needs only the step."""
    g = torch.Generator().manual_seed(hash((cfg.seed, step, micro, run.rank)) % 2**31)
    x = torch.randint(0, 64, (engine.train_micro_batch_size_per_gpu(),), generator=g)
    noise = torch.randint(0, 2, x.shape, generator=g)
    return x, (x * 7 + 3 + noise) % 64  # two likely answers: the loss can fall to ln 2


step = 0
if (found := run.resume()) is not None:
    engine.load_checkpoint(str(found.folder / "deepspeed"), tag="state")
    step = found.step
    run.check_resume(engine)  # the loaded weights are the ones committed, or the run stops here
while step < cfg.steps:
    for micro in range(engine.gradient_accumulation_steps()):
        x, y = batch(step, micro)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
    step += 1
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.AVG)
    run.report(step, loss=mean.item())
    stop = run.should_stop()
    if stop or step % cfg.checkpoint.every_steps == 0:
        folder = run.begin_checkpoint(step)
        engine.save_checkpoint(str(folder / "deepspeed"), tag="state", save_latest=False)
        run.commit_checkpoint(step, model=engine, loss=mean.item())  # + the weights' fingerprint
    if stop and step < cfg.steps:
        run.exit_for_requeue(step)
run.finish(step)
if run.rank == 0:
    print(f"finished {step} steps, final loss {mean.item():.4f}")
