"""Your own Accelerate loop under orchestrate (run by configs/accelerate.yaml): the usual
`accelerator.prepare` / `backward` / `save_state` / `load_state` loop, with
`train_entry.integrations.accelerate.Lifecycle` for resume, heartbeats, the checkpoint
signal, committed checkpoints and requeue."""

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

from train_entry.integrations.accelerate import Lifecycle

accelerator = Accelerator(cpu=not torch.cuda.is_available())
torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.1), nn.Linear(256, 64))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
life = Lifecycle(accelerator, model)
steps, rank = life.config.steps, accelerator.process_index


def batch(step: int):
    """The data of (step, rank): a pure function, so resuming needs only the step."""
    g = torch.Generator().manual_seed(1000003 * step + rank)
    x = torch.randint(0, 64, (16,), generator=g)
    return x, (x * 7 + 3 + torch.randint(0, 2, x.shape, generator=g)) % 64


step = life.resume()
while step < steps:
    x, y = batch(step)
    loss = F.cross_entropy(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    step += 1
    mean = accelerator.reduce(loss.detach(), "mean").item()
    life.report(step, loss=mean, lr=scheduler.get_last_lr()[0])
    stop = life.should_stop()
    if stop or step % 20 == 0:
        life.save(step, loss=mean)
    if stop and step < steps:
        life.exit_for_requeue(step)
life.finish(step)
accelerator.print(f"finished {step} steps, final loss {mean:.4f}")
