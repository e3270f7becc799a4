"""A script with train_entry.client that logs to W&B (offline) and TensorBoard with no
tracker settings of its own, and leaves for a requeue once (first launch, --leave-at):
the next launch must continue the same W&B run and TensorBoard folder."""

import argparse
import os

import torch
import torch.distributed as dist

from train_entry import client

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=12)
parser.add_argument("--leave-at", type=int, default=6)
args = parser.parse_args()
dist.init_process_group("gloo")
run = client.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = 0
if (found := run.resume()) is not None:
    state = torch.load(found.folder / "state.pt")
    model.load_state_dict(state["model"])
    step = found.step
writer = tb = None
if run.rank == 0:
    import wandb
    from torch.utils.tensorboard import SummaryWriter

    wb = wandb.init(project="orchestrate-test", mode="offline")  # id, resume and dir from the agent
    tb = SummaryWriter(log_dir=os.environ["ORCHESTRATE_TENSORBOARD_DIR"])
first_launch = os.environ["ORCHESTRATE_LAUNCH"].endswith(".0")
while step < args.steps:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    run.report(step, loss=loss.item())
    if run.rank == 0:
        wb.log({"loss": loss.item()}, step=step)
        tb.add_scalar("loss", loss.item(), step)
    if first_launch and step == args.leave_at:
        folder = run.begin_checkpoint(step)
        if run.rank == 0:
            torch.save({"model": model.state_dict()}, folder / "state.pt")
        run.commit_checkpoint(step)
        if run.rank == 0:
            tb.close()
            wb.finish()
        run.exit_for_requeue(step)
run.finish(step)
if run.rank == 0:
    tb.close()
    wb.finish()
dist.destroy_process_group()
