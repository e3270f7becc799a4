"""A plain torch.distributed training script, run by orchestrate as it is (configs/command.yaml).

It knows nothing of orchestrate: like under torchrun, it reads RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT (``init_process_group``'s env:// default). orchestrate's
node agent starts it once per rank, restarts it in place when a rank dies, and watches
its output: a run that stops printing for longer than heartbeat.timeout_s is a hang.
With --save it keeps its own checkpoint and resumes from it after a restart.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--sleep", type=float, default=0.0, help="seconds between steps (a slower model)")
parser.add_argument("--save", default=None, help="checkpoint file: rank 0 writes it, every rank resumes from it")
parser.add_argument("--save-every", type=int, default=50)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
target = torch.arange(16.0)[:, None] / 16

step = 0
if args.save and os.path.exists(args.save):
    state = torch.load(args.save)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]
    print(f"resumed from step {step}", flush=True)
while step < args.steps:
    g = torch.Generator().manual_seed(step * world + rank)
    x = torch.randn(32, 16, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), x @ target)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    print(f"step {step} loss {loss.item():.5f}", flush=True)
    if args.save and rank == 0 and step % args.save_every == 0:
        tmp = f"{args.save}.tmp"
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
        os.replace(tmp, args.save)  # a crash mid-save leaves the previous checkpoint whole
    time.sleep(args.sleep)
dist.destroy_process_group()
