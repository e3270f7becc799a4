"""Saves DeepSpeed ZeRO-2 and ZeRO-3 checkpoints (2 ranks, gloo) of a model with what
fine-tuning checkpoints hold and the built-in model lacks: frozen parameters (as LoRA
leaves the base), a tied weight, and integer and float buffers.

    python tests/workloads/zero_frozen_tied.py OUT_DIR   ->  OUT_DIR/z2/deepspeed/state, OUT_DIR/z3/...
"""

import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(37, 13)
        self.frozen = torch.nn.Linear(13, 29)
        self.mid = torch.nn.Linear(29, 13)
        self.head = torch.nn.Linear(13, 37, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("counts", torch.arange(5))
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return self.head(self.mid(self.frozen(self.emb(x)))) * self.scale.sum()


def rank(r: int, stage: int, out: str, port: int) -> None:
    os.environ.update(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    from torch import distributed as dist

    from train_entry.engines.deepspeed import skip_unneeded_op_builds

    skip_unneeded_op_builds(torch.device("cpu"))
    import deepspeed

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    m = Model()
    for p in m.frozen.parameters():
        p.requires_grad_(False)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage}}
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    engine, *_ = deepspeed.initialize(model=m, optimizer=opt, config=cfg, dist_init_required=False)
    loss = engine(torch.randint(0, 37, (2, 4))).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, tag="state", save_latest=False)
    # both ranks done with every collective before either tears gloo down: without it a rank
    # leaving early aborted the other now and then ("terminate called without an active exception")
    dist.barrier()
    dist.destroy_process_group()
    # and leave without C++ teardown: a library thread still joinable at exit aborted rank 1 now and
    # then even after the barrier; the checkpoint files are closed by now, so nothing is lost
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    base = Path(sys.argv[1])
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 29731
    for stage in (2, 3):
        mp.spawn(rank, args=(stage, str(base / f"z{stage}" / "deepspeed"), port + stage - 2), nprocs=2)
