"""One training process (rank): ``python -m train_entry.worker TASK_DIR``.

Started by the node agent with torchrun-compatible variables. Exits with a code from
``contract.ExitCode``; on failure it first records the exception, its traceback and
whose fault it was (``errors``) where the login side finds them.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
import traceback

STARTED = time.time()  # the ledger's resume event tells start-up and load time apart (recovery figures)

from orchestrator import contract  # noqa: E402
from orchestrator.contract import ExitCode, envvars  # noqa: E402

from train_entry import errors, faults  # noqa: E402
from train_entry.checkpoint.auto import AutoInterval  # noqa: E402
from train_entry.checkpoint.policy import Due, SavePolicy  # noqa: E402
from train_entry.env import RankContext  # noqa: E402
from train_entry.session import RankSession  # noqa: E402


def _forker_started(default: float) -> float:
    """A forked rank's start is its forker's: the imports done there were this rank's start-up."""
    try:
        return min(default, float(os.environ.get(envvars.RANK_STARTED) or default))
    except ValueError:
        return default


STARTED = _forker_started(STARTED)

# torch is imported inside the functions: the rank's first heartbeat comes before its import


def pick_device(cfg: contract.TaskConfig, ctx: RankContext):
    import torch

    backend = cfg.engine["backend"]
    use_cuda = cfg.resources.gpus_per_task > 0 and torch.cuda.is_available()
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


def build(session: RankSession, device):
    """Checkpointer, snapshots, workload, engine and the step to start from (the newest good
    checkpoint's, or a newer snapshot's)."""
    import torch

    from train_entry.checkpoint.checkpointer import Checkpointer
    from train_entry.checkpoint.snapshot import Snapshots
    from train_entry.engines import build_engine
    from train_entry.models import build_workload

    cfg, ctx = session.cfg, session.ctx
    if cfg.engine.get("deterministic") and device.type == "cuda":  # atomics in backward (embeddings, scatter) differ run to run
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read at cuBLAS's first handle, made later
        torch.use_deterministic_algorithms(True, warn_only=True)  # a kernel without a deterministic twin: said, not fatal
    ckpt = Checkpointer(cfg, ctx.rank, ctx.world_size)
    durable = ckpt.find_resume()
    snaps = Snapshots(cfg, ctx.rank, ctx.world_size, ctx.launch, session.hb)
    resume = snaps.choose(durable)
    torch.manual_seed(cfg.seed)  # same initial weights on every rank
    if cfg.model["kind"] == "hf":
        from train_entry import hf
        from train_entry.hf.weights import heap_returned

        with heap_returned():  # the load's temporaries go back to the system, not into the heap
            workload = hf.build(cfg, session.task_dir, ctx, session.hb, log=lambda line: ctx.rank == 0 and print(line, flush=True))
            engine = build_engine(cfg, workload.model, device, resume, trainable_only=workload.trainable_only, fill=workload.fill)
    else:
        workload = build_workload(cfg.model, cfg.data)
        engine = build_engine(cfg, workload.model, device, resume, trainable_only=workload.trainable_only)
    ckpt.engine = engine
    if snaps.ckpt is not None:
        snaps.ckpt.engine = engine
    if workload.export is not None:
        ckpt.extras[contract.HF_EXPORT] = workload.export
    torch.manual_seed(cfg.seed * 7919 + ctx.rank)  # per-rank dropout streams
    step = 0
    if resume.folder is not None:
        t0 = time.time()
        settle(engine, workload, session, device)
        ckpt.load(resume)
        resume.startup_s, resume.load_s = t0 - STARTED, time.time() - t0
        step = resume.step
        ckpt.committed_step = durable.step if durable.folder is not None else None  # in storage
        faults.reinit_after_load(engine.model)  # tests: a loader that re-creates a layer
    resume.report(session.hb)
    return ckpt, snaps, workload, engine, step, resume


def settle(engine, workload, session: RankSession, device) -> None:
    """Collective: ``engine.settle`` on the first micro-batch, leaving the model's buffers and
    every random stream as they were (the load restores only what the checkpoint holds)."""
    from train_entry.data import Sampler
    from train_entry.checkpoint.resume_check import untouched

    cfg, ctx = session.cfg, session.ctx
    sampler = Sampler(len(workload.dataset), cfg.seed, cfg.batch.micro_batch_size, 1, ctx.world_size, ctx.rank)
    with untouched(engine.model, device, grad=True):
        engine.settle(*sampler.batch(workload.dataset, 0, 0, device), workload.loss)


class Loop:
    """The built-in training loop. ``run`` returns the last logged loss, or raises
    StopRequested once saved on the checkpoint signal."""

    def __init__(self, session: RankSession, device):
        import torch
        from torch import distributed as dist

        from train_entry.data import Sampler

        self.session, self.hb, self.cfg, self.device = session, session.hb, session.cfg, device
        self.ckpt, self.snaps, self.workload, self.engine, self.step, resume = build(session, device)
        ctx, batch = session.ctx, self.cfg.batch
        self.accum = batch.grad_accum
        self.sampler = Sampler(len(self.workload.dataset), self.cfg.seed, batch.micro_batch_size, self.accum, ctx.world_size, ctx.rank)
        self.items_per_step = batch.micro_batch_size * self.accum * ctx.world_size * self.workload.tokens_per_sample
        self.agree = Agreement(dist, torch)
        # when a save is due; the watermark of evaluations (pins/) says the watcher evaluates checkpoints
        self.policy = SavePolicy.of(self.cfg.checkpoint, contract.unseen_after(self.cfg.task_dir) is not None)
        self.auto = AutoInterval(self.cfg.checkpoint, self.session.task_dir, ctx.rank, self.hb)  # every_steps: auto
        self.last_loss: float | None = None
        self.step_losses: list = []  # the micro-batch losses of the last step (a save records their mean)
        if resume.folder is not None:  # before the first step: the loaded state is the one committed
            from train_entry.checkpoint.fingerprint import ResumeMismatch
            from train_entry.checkpoint.resume_check import verify

            try:
                verify(resume.folder, self.engine, self.workload.dataset, self.workload.loss, self.hb, self.cfg)
            except ResumeMismatch as exc:
                if not resume.snapshot:
                    raise
                self.snaps.reject(resume, exc)
        self.window_t0, self.window_steps = time.perf_counter(), 0
        self.eval_s = 0.0  # evaluating since the last metrics line

    def run(self) -> float | None:
        total, ckpt = self.cfg.steps, self.ckpt
        self.hb.beat(self.step, contract.Phase.TRAIN, force=True)
        # where this generation's training begins: the report's goodput splits start-up from steps here
        self.hb.event("train.started", f"training from step {self.step}, {time.time() - STARTED:.1f} s after the process started",
                      step=self.step, startup_s=time.time() - STARTED)
        self.window_t0, self.window_steps = time.perf_counter(), 0
        while self.step < total:
            lr, losses = self.optimizer_step()
            # what every rank posted one step ago (done by now: it ran during this step), taken before
            # any other collective of ours, so that none of them ever runs beside it
            signal, timed = self.agree.drain()
            self.log(lr, losses, self.evaluate())
            self.saved(ckpt.poll_pending(), "asynchronous")
            due = self.policy.due(self.step, total, signal, timed)  # the same at the same step on every rank
            if due is Due.SIGNAL:
                self.save("on the checkpoint signal", final=True)
                self.session.leave_for_requeue(self.step)
                raise StopRequested(self.step)
            if due is Due.SCHEDULED:
                self.save("scheduled")
            elif self.snaps.due(self.step) and self.step < total:
                self.save("a snapshot in memory", final=True, snapshot=True)
            if self.step < total:  # posted after the save, so a timed save is not asked for twice
                now = time.time()
                self.agree.post(self.session.signal.raised,
                                self.policy.by_time(ckpt.last_save_time, now) or self.auto.due(ckpt.last_save_time, now))
            self.hb.beat(self.step, contract.Phase.TRAIN)
        self.finish_pending()
        if self.policy.final_save(self.step, ckpt.committed_step):
            self.save("the final step, for consolidation or evaluation", final=True)  # the weights as trained
        ckpt.close()
        self.snaps.close()
        self.session.finish(self.step)
        return self.last_loss

    def optimizer_step(self):
        from train_entry.schedule import lr_at

        t0 = time.perf_counter()
        lr = lr_at(self.step, self.cfg.steps, self.cfg.optimizer, self.cfg.schedule)
        losses = []
        for m in range(self.accum):
            inputs, targets = self.sampler.batch(self.workload.dataset, self.step, m, self.device)
            losses.append(self.engine.micro_step(inputs, targets, self.workload.loss, self.accum, last=m == self.accum - 1))
        self.engine.optimizer_step(lr)
        faults.slow_step(self.step + 1)  # tests: a step's wall time that no machine makes shorter
        self.step_losses = losses
        self.step += 1
        self.window_steps += 1
        self.hb.stepped(time.perf_counter() - t0, steady=True)  # saves and evaluations beat phases of their own
        return lr, losses

    def evaluate(self) -> float | None:
        """The held-out loss, every ``eval.every_steps`` and at the last step (collective)."""
        every, w = self.cfg.eval.every_steps, self.workload
        if not every or w.eval_dataset is None or not (self.step % every == 0 or self.step == self.cfg.steps):
            return None
        from train_entry.evaluate import evaluate

        ctx = self.session.ctx
        self.hb.beat(self.step, contract.Phase.EVAL, force=True)
        t0 = time.perf_counter()
        loss = evaluate(self.engine, w.eval_dataset, w.loss_sum, self.cfg.batch.micro_batch_size, ctx.world_size, ctx.rank,
                        self.cfg.eval.max_batches, on_batch=lambda: self.hb.beat(self.step, contract.Phase.EVAL))
        took = time.perf_counter() - t0
        self.window_t0 += took  # evaluation is not training time
        self.eval_s += took
        return loss

    def log(self, lr: float, losses: list, eval_loss: float | None = None) -> None:
        import torch
        from torch import distributed as dist

        step = self.step
        if eval_loss is not None or step == 1 or step % self.cfg.logging.every_steps == 0 or step == self.cfg.steps:
            loss = torch.stack(losses).mean().float()
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            self.last_loss = float(loss)
            now = time.perf_counter()
            self.hb.metric(step, self.last_loss, lr, self.items_per_step * self.window_steps / max(now - self.window_t0, 1e-9),
                           eval_loss=eval_loss, eval_s=self.eval_s)
            self.window_t0, self.window_steps, self.eval_s = now, 0, 0.0

    def save(self, why: str, final: bool = False, snapshot: bool = False) -> None:
        """Collective. ``snapshot``: into the node's memory (``self.snaps``), not storage."""
        from train_entry.checkpoint import resume_check
        from train_entry.checkpoint.progress import SaveProgress

        ckpt = self.snaps.ckpt if snapshot else self.ckpt
        folder = contract.checkpoints_dir(ckpt.task_dir)
        with SaveProgress(self.hb, self.step, folder, self.cfg.heartbeat.interval_s) as progress:
            w = self.workload
            # what the resume check compares: the step's loss, and the next step's first micro-batch's
            probe = resume_check.next_step_probe(self.engine, w.dataset, w.loss, self.sampler, self.step, self.cfg)
            meta = {"launch": self.session.ctx.launch, "probe": probe}
            if self.step_losses:
                meta["loss"] = resume_check.step_loss(self.step_losses)
            progress.advance()
            ckpt.on_progress = progress.advance
            try:
                info = ckpt.save(self.step, meta, final=final)
            finally:
                ckpt.on_progress = None
        if snapshot:
            self.snaps.taken_one(info)
        else:
            self.saved(info, why)

    def finish_pending(self) -> None:
        """The last asynchronous save's write waited for: a save's phase, beating as it
        advances (a large write may take far longer than a steady step's hang timeout)."""
        from train_entry.checkpoint.progress import SaveProgress

        if self.ckpt.pending is None:
            return
        with SaveProgress(self.hb, self.step, contract.checkpoints_dir(self.session.task_dir), self.cfg.heartbeat.interval_s):
            self.saved(self.ckpt.finish_pending(), "asynchronous")

    def saved(self, info: dict | None, why: str) -> None:
        if info and info.get("total_s") is not None:
            self.hb.save_took(info["total_s"])
        if info and info.get("folder"):
            self.auto.saved(info.get("blocked_s"))
            self.hb.event("checkpoint.committed", f"step {info['step']} saved ({why}): training blocked {info['blocked_s']:.2f} s, "
                          f"{info['total_s']:.2f} s in all", **info)


def record_failure(session: RankSession, exc: BaseException) -> ExitCode:
    """Classify the exception, print it to the rank's log, and record it for the login side.
    A full or failing filesystem: the save's uncommitted folder goes first (it holds the
    space the record needs), and what still cannot be written is said on stderr."""
    code = errors.classify(exc)
    ctx, hb = session.ctx, session.hb
    record = errors.error_record(exc, code, ctx.rank, hb.step, ctx.generation)  # its time: before any clean-up
    if code == ExitCode.STORAGE:
        contract.remove_leftovers(session.task_dir)  # never a committed checkpoint
    try:
        traceback.print_exception(exc)
        contract.atomic_write_json(contract.error_path(session.task_dir, ctx.launch, ctx.rank), record)
        hb.beat(hb.step, contract.Phase.FAILED, force=True)
    except OSError as write_error:
        if code != ExitCode.STORAGE:
            raise
        print(f"orchestrate worker: rank {ctx.rank}: {record.get('storage_errno')} on {record.get('storage_path')}; "
              f"the error record could not be written either ({write_error})", file=sys.__stderr__)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m train_entry.worker TASK_DIR", file=sys.stderr)
        return ExitCode.USER_ERROR
    try:
        session = RankSession(argv[0])
        from torch import distributed as dist
    except contract.TaskConfigError as exc:
        print(f"orchestrate worker: {exc}", file=sys.stderr)
        return ExitCode.INFRA_ERROR
    except Exception:  # noqa: BLE001 - before the loop nothing is the user's: never exit 1 (their error)
        traceback.print_exc()
        return ExitCode.INTERNAL_ERROR
    ctx = session.ctx

    try:
        device, backend = pick_device(session.cfg, ctx)
        dist.init_process_group(
            backend,
            timeout=datetime.timedelta(seconds=600),
            **({"device_id": device} if device.type == "cuda" else {}),
        )
        loss = Loop(session, device).run()
        if ctx.rank == 0:
            print(f"finished {session.cfg.steps} steps, final loss {loss:.4f}", flush=True)
        return ExitCode.OK
    except StopRequested as stop:
        if ctx.rank == 0:
            print(f"saved at step {stop.args[0]} on the checkpoint signal; asking to be requeued", flush=True)
        return ExitCode.REQUEUE
    except BaseException as exc:  # noqa: BLE001 - every failure is classified and recorded
        return record_failure(session, exc)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot be torn down cleanly
                pass


if __name__ == "__main__":
    sys.exit(main())
