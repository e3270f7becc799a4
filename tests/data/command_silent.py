"""A plain torch.distributed program (no orchestrate import) that goes silent: on the
first generation of a launch, rank 1 stops printing at --silent-at and sleeps (rank 0
then waits for it in a collective, silent too). A restarted generation runs through."""

import argparse
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--silent-at", type=int, default=10)
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
first = os.environ.get("ORCHESTRATE_GENERATION") == "0"
for step in range(1, args.steps + 1):
    if first and rank == 1 and step == args.silent_at:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"step {step} sum {t.item()}", flush=True)
    time.sleep(0.1)
dist.destroy_process_group()
