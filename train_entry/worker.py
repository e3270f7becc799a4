"""One training process (rank): ``python -m train_entry.worker TASK_DIR``.

Started by the node agent with torchrun-compatible variables. Exits with a code
from ``orchestrator.contract.ExitCode``; on failure it first records the exception
and traceback where the login side finds them.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import time
import traceback

STARTED = time.time()  # the ledger's resume event tells start-up and load time apart (recovery figures)

from orchestrator import contract  # noqa: E402
from orchestrator.contract import ExitCode  # noqa: E402

from train_entry.env import RankContext, rank_context  # noqa: E402
from train_entry.heartbeat import Heartbeat, enable_stack_dumps

_INFRA = re.compile(
    r"gloo|nccl|connection (closed|reset|refused)|broken pipe|timed? ?out|socket|store|rendezvous|peer",
    re.IGNORECASE,
)


def classify(exc: BaseException) -> ExitCode:
    """Exit code for an exception: was it the user's code, or the machinery around it?"""
    import torch
    from torch import distributed as dist

    from train_entry.models import UserCodeError

    if isinstance(exc, UserCodeError):
        return ExitCode.USER_ERROR
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return ExitCode.OUT_OF_MEMORY
    if isinstance(exc, getattr(dist, "DistError", ())):
        return ExitCode.INFRA_ERROR
    if isinstance(exc, (RuntimeError, OSError, ConnectionError)) and _INFRA.search(str(exc)):
        return ExitCode.INFRA_ERROR
    return ExitCode.USER_ERROR


def pick_device(cfg: dict, ctx: RankContext):
    import torch

    backend = cfg["engine"].get("backend", "auto")
    use_cuda = cfg["resources"]["gpus_per_task"] > 0 and torch.cuda.is_available()
    if use_cuda:
        # one device per rank: the agent exposes the node's GPUs, LOCAL_RANK picks one
        torch.cuda.set_device(ctx.local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if backend == "nccl":
        # CPU tensors (the step agreement, DCP's planning) go through gloo: no device sync for them
        backend = "cpu:gloo,cuda:nccl"
    return device, backend


class Agreement:
    """Ranks agree on the checkpoint signal and on time-based saves one step late, through an
    all-reduce that runs during the next step: waiting for one every step cost about 4 % of a
    40 ms step on gloo. Step-based saves need no agreement (every rank counts)."""

    def __init__(self, dist, torch):
        self.dist, self.work = dist, None
        self.buf = torch.zeros(2, dtype=torch.int32)  # reused: drain() waits before the next post

    def post(self, signal: bool, timed_save: bool) -> None:
        self.buf[0], self.buf[1] = int(signal), int(timed_save)
        self.work = self.dist.all_reduce(self.buf, op=self.dist.ReduceOp.MAX, async_op=True)

    def drain(self) -> tuple[bool, bool]:
        """What the ranks posted the step before (max over ranks); nothing if nothing was posted."""
        if self.work is None:
            return False, False
        self.work.wait()
        self.work = None
        return bool(self.buf[0]), bool(self.buf[1])


class StopRequested(Exception):
    """The checkpoint signal came: the run was saved and asks to be requeued."""


def train(cfg: dict, ctx: RankContext, device, hb: Heartbeat, flag) -> float | None:
    import torch
    from torch import distributed as dist

    from train_entry.checkpoint import Checkpointer
    from train_entry.data import Sampler
    from train_entry.engines import build_engine
    from train_entry.models import build_workload
    from train_entry.schedule import lr_at

    ckpt = Checkpointer(cfg, cfg["task_dir"], ctx.rank, ctx.world_size)
    resume = ckpt.find_resume()
    torch.manual_seed(cfg["seed"])  # same initial weights on every rank
    workload = build_workload(cfg)
    engine = build_engine(cfg, workload.model, device, resume)
    ckpt.engine = engine
    torch.manual_seed(cfg["seed"] * 7919 + ctx.rank)  # per-rank dropout streams
    step = 0
    if resume.folder is not None:
        t0 = time.time()
        ckpt.load(resume)
        resume.startup_s, resume.load_s = t0 - STARTED, time.time() - t0
        step = ckpt.committed_step = resume.step
    resume.report(hb)
    mb, accum = cfg["batch"]["micro_batch_size"], cfg["batch"]["grad_accum"]
    sampler = Sampler(len(workload.dataset), cfg["seed"], mb, accum, ctx.world_size, ctx.rank)
    total, every = cfg["steps"], cfg["logging"]["every_steps"]
    items_per_step = mb * accum * ctx.world_size * workload.tokens_per_sample

    def saved(info: dict | None, why: str) -> None:
        if info and info.get("folder"):
            hb.event("checkpoint.committed", f"step {info['step']} saved ({why}): training blocked {info['blocked_s']:.2f} s, "
                  f"{info['total_s']:.2f} s in all", **info)

    last_loss = None
    hb.beat(step, "train", force=True)
    window_t0, window_steps = time.perf_counter(), 0
    agree = Agreement(dist, torch)
    while step < total:
        t0 = time.perf_counter()
        lr = lr_at(step, total, cfg["optimizer"], cfg["schedule"])
        losses = []
        for m in range(accum):
            inputs, targets = sampler.batch(workload.dataset, step, m, device)
            losses.append(engine.micro_step(inputs, targets, workload.loss, accum, last=m == accum - 1))
        engine.optimizer_step(lr)
        step += 1
        window_steps += 1
        hb.step_time_s = time.perf_counter() - t0
        # what every rank posted one step ago (done by now: it ran during this step), taken before
        # any other collective of ours, so that none of them ever runs beside it
        signal, timed = agree.drain()
        if step == 1 or step % every == 0 or step == total:
            loss = torch.stack(losses).mean().float()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            last_loss = float(loss)
            now = time.perf_counter()
            hb.metric(step, last_loss, lr, items_per_step * window_steps / max(now - window_t0, 1e-9))
            window_t0, window_steps = now, 0
        saved(ckpt.poll_pending(), "asynchronous")
        if signal and step < total:  # acted on at the same step on every rank
            hb.beat(step, "saving", force=True)
            saved(ckpt.save(step, {"launch": ctx.launch}, final=True), "on the checkpoint signal")
            hb.beat(step, "requeue", force=True)
            raise StopRequested(step)
        if ckpt.due_by_step(step, total) or (timed and step < total):
            hb.beat(step, "saving", force=True)
            saved(ckpt.save(step, {"launch": ctx.launch}), "scheduled")
        if step < total:  # posted after the save, so a timed save is not asked for twice
            agree.post(flag.raised, ckpt.due_by_time())
        hb.beat(step, "train")
    saved(ckpt.finish_pending(), "asynchronous")
    if cfg["checkpoint"].get("consolidate") and ckpt.committed_step != step:
        hb.beat(step, "saving", force=True)  # the weights the job's consolidation step writes out
        saved(ckpt.save(step, {"launch": ctx.launch}, final=True), "the final step, for consolidation")
    hb.beat(step, "done", force=True)
    return last_loss


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m train_entry.worker TASK_DIR", file=sys.stderr)
        return ExitCode.USER_ERROR
    task_dir = argv[0]
    cfg = contract.read_json(contract.task_config_path(task_dir))
    if cfg is None:
        print(f"cannot read {contract.task_config_path(task_dir)}", file=sys.stderr)
        return ExitCode.INFRA_ERROR
    ctx = rank_context(os.environ)
    hb = Heartbeat(task_dir, ctx, cfg["heartbeat"]["interval_s"])
    enable_stack_dumps(task_dir, ctx)
    from train_entry.checkpoint import CheckpointSignal

    flag = CheckpointSignal(cfg["checkpoint"]["signal"])
    hb.beat(0, "init", force=True)
    from torch import distributed as dist

    try:
        device, backend = pick_device(cfg, ctx)
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=600),
            **({"device_id": device} if device.type == "cuda" else {}),
        )
        loss = train(cfg, ctx, device, hb, flag)
        flag.ignore()  # done: a signal that comes now (the time limit is near) must not kill a finished rank
        if ctx.rank == 0:
            print(f"finished {cfg['steps']} steps, final loss {loss:.4f}", flush=True)
        return ExitCode.OK
    except StopRequested as stop:
        flag.ignore()  # saved and leaving: a second signal must not turn exit 75 into a kill
        if ctx.rank == 0:
            print(f"saved at step {stop.args[0]} on the checkpoint signal; asking to be requeued", flush=True)
        return ExitCode.REQUEUE
    except BaseException as exc:  # noqa: BLE001 - every failure is classified and recorded
        code = classify(exc) if not isinstance(exc, KeyboardInterrupt) else ExitCode.CANCELLED
        traceback.print_exc()
        contract.atomic_write_json(
            contract.error_path(task_dir, ctx.launch, ctx.rank),
            {
                "rank": ctx.rank,
                "exit_code": int(code),
                "type": type(exc).__name__,
                "message": str(exc)[:2000],
                "traceback": traceback.format_exc()[-8000:],
                "step": hb.step,  # the step being trained when it raised: tells a repeating error
                "generation": ctx.generation,
                "time": time.time(),
            },
        )
        hb.beat(hb.step, "failed", force=True)
        return code
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot be torn down cleanly
                pass


if __name__ == "__main__":
    sys.exit(main())
