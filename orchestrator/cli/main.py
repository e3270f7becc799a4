"""The `orchestrate` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from orchestrator import __version__

from orchestrator import contract

from orchestrator.cli import render

from orchestrator.ledger import access

from orchestrator.submit import submission

from orchestrator.supervise import refresh

from orchestrator.supervise import cancel
from orchestrator.errors import UserError
from orchestrator.supervise.states import TaskState

EPILOG = "The ledger lives in --home, else $ORCHESTRATE_HOME, else ~/.orchestrate."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orchestrate", description="Batch orchestration and fault tolerance for distributed training on SLURM.", epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"orchestrate {__version__}")
    p.add_argument("--home", help="folder of the ledger (default: $ORCHESTRATE_HOME or ~/.orchestrate)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def spec_args(sp):
        sp.add_argument("spec", help="experiment spec (YAML)")
        sp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a spec field (repeatable)")

    sp = sub.add_parser("validate", help="check a spec and report every error with its field and line")
    spec_args(sp)

    sp = sub.add_parser("schema", help="print the spec's JSON Schema (for editors), or its reference as Markdown")
    sp.add_argument("--markdown", action="store_true", help="the field reference as a Markdown table")

    sp = sub.add_parser("plan", help="per-GPU memory and communication of each engine, and the one to use")
    spec_args(sp)
    sp.add_argument("--gpu-memory", metavar="SIZE", help="memory of one GPU, e.g. 80G (default: resources.gpu_memory)")
    sp.add_argument("--nodes", type=int, help="nodes (default: resources.nodes)")
    sp.add_argument("--gpus-per-node", type=int, help="GPUs (ranks) per node (default: resources.tasks_per_node)")
    sp.add_argument("--task", type=int, default=0, help="which sweep task to plan (default 0)")
    sp.add_argument("--json", action="store_true")

    sp = sub.add_parser("submit", help="validate, expand the sweep and submit every task")
    spec_args(sp)
    sp.add_argument("--executor", choices=["local", "slurm"], help="default: slurm when sbatch is found, else local")
    sp.add_argument("--dry-run", action="store_true", help="print the plan; submit and record nothing")
    sp.add_argument("--watch", "--wait", dest="watch", action="store_true",
                    help="stay and watch (recover failures) until every task ends; exit 0 only if all completed")
    sp.add_argument("--interval", type=float, default=2.0, help="seconds between watcher cycles with --watch (default 2)")
    sp.add_argument("--json", action="store_true", help="print the plan or the final status as JSON")

    sp = sub.add_parser("watch", help="ingest heartbeats, poll the scheduler, detect hangs and recover failures")
    sp.add_argument("experiment", nargs="?", help="id or name; default: every live experiment, until stopped")
    sp.add_argument("--interval", type=float, default=5.0, help="seconds between cycles (default 5); one scheduler poll each")
    sp.add_argument("--once", action="store_true", help="one cycle, then exit")
    sp.add_argument("--sbatch", action="store_true", help="run this watcher as a small SLURM job instead (for login nodes that stop long processes)")
    sp.add_argument("--time", default="7-00:00:00", help="time limit of the --sbatch job (default 7 days)")

    sp = sub.add_parser("status", help="tasks with state, attempts, step, loss, throughput, heartbeat age")
    sp.add_argument("experiment", nargs="?", help="id or name (a name means the newest experiment of that name)")
    sp.add_argument("--json", action="store_true", help="machine-readable (format in the README)")
    sp.add_argument("--all", action="store_true", help="every experiment with this name, not only the newest")

    sp = sub.add_parser("logs", help="the output of one rank of one task")
    sp.add_argument("experiment")
    sp.add_argument("--task", type=int, default=0)
    sp.add_argument("--rank", type=int, default=0)
    sp.add_argument("-f", "--follow", action="store_true", help="keep printing until the task ends")

    sp = sub.add_parser("events", help="the history of an experiment: every state change with its cause")
    sp.add_argument("experiment")
    sp.add_argument("--json", action="store_true")

    sp = sub.add_parser("ckpt", help="list, verify, prune and consolidate sharded checkpoints")
    ck = sp.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    c = ck.add_parser("list", help="every checkpoint: step, engine, world size, size, committed, verified")
    c.add_argument("target", help="experiment id or name, run folder, task folder, or checkpoint folder")
    c.add_argument("--deep", action="store_true", help="verify sha256 of every file too (reads everything)")
    c.add_argument("--json", action="store_true")
    c = ck.add_parser("verify", help="check one checkpoint: every file present, sizes and sha256 as the manifest says")
    c.add_argument("path", help="a step-N folder (or a task folder: its newest checkpoint)")
    c = ck.add_parser("consolidate", help="one checkpoint -> full weights (safetensors shards + index), streaming")
    c.add_argument("path", help="a step-N folder (or a task folder: its newest good checkpoint)")
    c.add_argument("--out", required=True, help="a new folder for the weights")
    c.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    c.add_argument("--format", default="safetensors", choices=["safetensors", "torch"])
    c.add_argument("--max-shard-size", default="5GB", help="largest output file (default 5GB): also the memory bound")
    c = ck.add_parser("prune", help="delete all but the newest K good checkpoints of each task")
    c.add_argument("target", help="experiment id or name, run folder, task folder, or checkpoints folder")
    c.add_argument("--keep", type=int, required=True, metavar="K")
    c.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")

    sp = sub.add_parser("cancel", help="stop an experiment's live tasks (never requeued)")
    sp.add_argument("experiment")
    sp.add_argument("--task", type=int, help="only this task")
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


# ---------------------------------------------------------------- commands


def cmd_validate(args) -> int:
    home = access.home_dir(args.home)
    plan = submission.make_plan(args.spec, args.overrides, "local", home)
    print(f"{args.spec}: valid, {len(plan.tasks)} task(s), world size {plan.resources.world_size} each")
    return 0


def cmd_schema(args) -> int:
    from orchestrator.spec.model import Spec

    if args.markdown:
        from orchestrator.spec.reference import markdown_reference

        print(markdown_reference())
    else:
        print(json.dumps(Spec.model_json_schema(), indent=2))
    return 0


def cmd_plan(args) -> int:
    from orchestrator.submit import memory_plan as mp
    from orchestrator.spec.units import parse_memory_mb

    home = access.home_dir(args.home)
    plan = submission.make_plan(args.spec, args.overrides, "local", home)
    tasks = {t.index: t for t in plan.tasks}
    if args.task not in tasks:
        raise UserError(f"--task {args.task}: the sweep has tasks 0..{len(tasks) - 1}")
    for flag, value in (("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node)):
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1")
    try:
        gpu_memory = parse_memory_mb(args.gpu_memory) * 1024**2 if args.gpu_memory else None
    except ValueError as exc:
        raise UserError(f"--gpu-memory: {exc}") from None
    spec = tasks[args.task].spec
    doc = mp.plan(mp.shape_of(spec), mp.setting_of(spec, args.nodes, args.gpus_per_node, gpu_memory))
    doc["spec_engine"] = mp.candidate_of(spec.engine)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _console().print(*render.memory_plan_tables(doc))
    return 0


def cmd_submit(args) -> int:
    home = access.home_dir(args.home)
    plan = submission.make_plan(args.spec, args.overrides, args.executor, home)
    from orchestrator.scheduler import get_scheduler

    get_scheduler(plan.executor)  # an unavailable executor is an error before anything is written
    if args.dry_run:
        if args.json:
            print(json.dumps(_dry_run_doc(plan), indent=2))
        else:
            print(_dry_run_text(plan))
        return 0
    ledger = access.open_ledger(home)
    job_ids = submission.submit(ledger, plan)
    jobs = ", ".join(sorted(set(job_ids.values())))
    print(f"submitted {plan.name} as {plan.experiment_id}: {len(plan.tasks)} task(s) ({plan.executor}: {jobs})", file=sys.stderr)
    print(f"run folder {plan.run_dir}", file=sys.stderr)
    if not args.watch:
        print(plan.experiment_id)
        return 0
    return _wait(ledger, plan.experiment_id, args.json, args.interval)


def _slurm_check(plan) -> str:
    """SLURM's own verdict on the plan (``sbatch --test-only``), when SLURM is here."""
    import shutil

    from orchestrator.scheduler.slurm import SlurmScheduler

    if not shutil.which("sbatch"):
        return "not checked: sbatch is not on PATH here"
    return SlurmScheduler().check(plan)  # raises SchedulerError when SLURM would refuse


def _dry_run_doc(plan) -> dict:
    doc = plan.summary()
    if plan.executor == "slurm":
        from orchestrator.scheduler.slurm import render_batch_script

        doc["sbatch_script"] = render_batch_script(plan)
        doc["slurm_check"] = _slurm_check(plan)
    return doc


def _dry_run_text(plan) -> str:
    from orchestrator.submit.plan import render_plan_text

    text = render_plan_text(plan)
    if plan.executor == "slurm":
        from orchestrator.scheduler.slurm import render_batch_script

        text += "\n\n# the batch script that would be submitted (one job array):\n" + render_batch_script(plan)
        text += f"\n# sbatch --test-only: {_slurm_check(plan)}"
    return text + "\n(dry run: nothing submitted, nothing recorded)"


def _wait(ledger, exp_id: str, as_json: bool, interval: float) -> int:
    """Watch one experiment (this process is its watcher) until it ends; show progress."""
    from rich.console import Console, Group
    from rich.live import Live

    from orchestrator.supervise import watcher

    console = Console(stderr=True)
    seen = [0]

    def show_events(ids):
        events = ledger.events(exp_id)
        for e in events[seen[0]:]:
            print(render.event_line(e), file=sys.stderr, flush=True)
        seen[0] = len(events)

    if console.is_terminal:
        with Live(console=console, refresh_per_second=2) as live:
            def show_table(ids):
                live.update(Group(*render.status_tables(render.status_document(ledger, [ledger.experiment(exp_id)]))))

            watcher.watch(ledger, [exp_id], interval, on_cycle=show_table)
    else:
        watcher.watch(ledger, [exp_id], interval, on_cycle=show_events)
    exp = ledger.experiment(exp_id)
    if not TaskState(exp["state"]).terminal:
        print(f"\nstopped watching; {exp_id} goes on. Watch it again with `orchestrate watch {exp_id}`, "
              f"stop it with `orchestrate cancel {exp_id}`.", file=sys.stderr)
        return 130
    doc = render.status_document(ledger, [exp])
    if as_json:
        print(json.dumps(doc, indent=2))
    else:
        _console().print(*render.status_tables(doc))
    return 0 if exp["state"] == TaskState.COMPLETED.value else 1


def cmd_watch(args) -> int:
    from orchestrator.supervise import watcher

    if args.interval <= 0:
        raise UserError("--interval must be positive")
    home = access.home_dir(args.home)
    if args.sbatch:
        return _watch_as_job(args, home)
    ledger = access.open_ledger(home)
    if args.experiment:
        exp = access.resolve_experiment(ledger, args.experiment)[0]
        if args.once:
            watcher.watch(ledger, [exp["id"]], args.interval, once=True)
            return 0
        return _wait(ledger, exp["id"], False, args.interval)
    seen: dict[str, int] = {}  # events already printed; history before the watcher started is not repeated

    def show(ids):
        for exp_id in ids:
            events = ledger.events(exp_id)
            start = seen.setdefault(exp_id, 0 if args.once else len(events))
            for e in events[start:]:
                print(f"{exp_id} {render.event_line(e)}", flush=True)
            seen[exp_id] = len(events)

    watcher.watch(ledger, None, args.interval, once=args.once, on_cycle=show)
    return 0


def _watch_as_job(args, home) -> int:
    """Submit `orchestrate watch` as a one-CPU SLURM job (the script holds only quoted argv)."""
    import shlex

    from orchestrator.scheduler import commands

    argv = [sys.executable, "-m", "orchestrator", "--home", str(home), "watch", "--interval", str(args.interval)]
    if args.experiment:
        argv.append(args.experiment)
    logs = home / "watcher"
    logs.mkdir(parents=True, exist_ok=True)
    script = logs / "watch.sbatch"
    contract.atomic_write_text(script, "#!/bin/bash\nexec " + " ".join(shlex.quote(a) for a in argv) + "\n")
    out = commands.run(
        ["sbatch", "--parsable", "-J", "orchestrate-watch", "-N1", "-n1", "-c1", f"--time={args.time}",
         "-o", str(logs / "watch-%j.log"), "--requeue", str(script)],
        timeout=60,
    )
    print(f"watcher submitted as SLURM job {out.stdout.strip()}; log in {logs}")
    return 0


def _console():
    """A terminal gets its own width; a pipe or file gets wide enough rows not to wrap."""
    import os

    from rich.console import Console

    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(width=160)
    return console


def _refresh_one(ledger, exp_id: str) -> dict:
    refresh.refresh(ledger, [ledger.experiment(exp_id)])
    return ledger.experiment(exp_id)


def cmd_status(args) -> int:
    ledger = access.open_ledger(access.home_dir(args.home))
    exps = access.resolve_experiment(ledger, args.experiment)
    if args.experiment and not args.all:
        exps = exps[:1]
    refresh.refresh(ledger, exps)
    exps = [ledger.experiment(e["id"]) for e in exps]
    doc = render.status_document(ledger, exps)
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    if not exps:
        print("no experiments yet; start one with `orchestrate submit SPEC`")
        return 0
    _console().print(*render.status_tables(doc))
    return 0


def cmd_events(args) -> int:
    ledger = access.open_ledger(access.home_dir(args.home))
    exp = access.resolve_experiment(ledger, args.experiment)[0]
    refresh.refresh(ledger, [exp])
    events = ledger.events(exp["id"])
    if args.json:
        print(json.dumps(events, indent=2))
    else:
        for e in events:
            print(render.event_line(e))
    return 0


def cmd_logs(args) -> int:
    ledger = access.open_ledger(access.home_dir(args.home))
    exp = access.resolve_experiment(ledger, args.experiment)[0]
    tasks = {t["idx"]: t for t in ledger.tasks(exp["id"])}
    if args.task not in tasks:
        raise UserError(f"experiment {exp['id']} has tasks 0..{len(tasks) - 1}, not {args.task}")
    path = contract.log_path(tasks[args.task]["task_dir"], args.rank)
    pos = 0
    while True:
        if path.exists():
            with open(path, encoding="utf-8", errors="replace") as fh:
                fh.seek(pos)
                chunk = fh.read()
                pos = fh.tell()
            sys.stdout.write(chunk)
            sys.stdout.flush()
        elif not args.follow:
            raise UserError(f"no log for task {args.task} rank {args.rank} yet ({path}); the task may not have started")
        if not args.follow:
            return 0
        exp = _refresh_one(ledger, exp["id"])
        if TaskState(ledger.task(exp["id"], args.task)["state"]).terminal:
            time.sleep(0.2)
            if path.exists() and path.stat().st_size == pos:
                return 0
        time.sleep(1.0)


def cmd_cancel(args) -> int:
    ledger = access.open_ledger(access.home_dir(args.home))
    exp = access.resolve_experiment(ledger, args.experiment)[0]
    done = cancel.cancel(ledger, exp, args.task)
    if done:
        print(f"cancelling task(s) {', '.join(map(str, done))} of {exp['name']} ({exp['id']})")
    else:
        print(f"nothing to cancel: no live task in {exp['name']} ({exp['id']})")
    return 0


def _one_checkpoint(path: str, good_only: bool = False):
    """A checkpoint folder as given, or the newest (good) one under a task folder."""
    from pathlib import Path

    from orchestrator.checkpoints import commands as ckpt

    folder = Path(path).expanduser()
    if (folder / contract.MANIFEST).exists() or folder.name.startswith((".tmp-", "step-")):
        return folder
    found = [c for c in ckpt.find(folder) if (c.verified if good_only else c.committed)]
    if not found:
        raise UserError(f"'{folder}' holds no {'good' if good_only else 'committed'} checkpoint; see `orchestrate ckpt list {folder}`")
    return found[-1].folder


def _ckpt_target(home, target: str):
    """(path, experiment or None) for an experiment reference or a path."""
    from pathlib import Path

    path = Path(target).expanduser()
    if path.exists():
        return path, None
    ledger = access.open_ledger(home)
    exp = access.resolve_experiment(ledger, target)[0]
    return Path(exp["run_dir"]), (ledger, exp)


def cmd_ckpt(args) -> int:
    from orchestrator.checkpoints import commands as ckpt

    home = access.home_dir(args.home)
    if args.ckpt_command == "consolidate":
        from train_entry.consolidate import ConsolidateError, consolidate

        from orchestrator.spec.units import parse_bytes

        try:
            max_bytes = parse_bytes(args.max_shard_size)
        except ValueError as exc:
            raise UserError(f"--max-shard-size: {exc}") from None
        folder = _one_checkpoint(args.path, good_only=True)
        try:
            done = consolidate(folder, args.out, args.dtype, args.format, max_bytes)
        except ConsolidateError as exc:
            raise UserError(str(exc)) from None
        print(f"{done['tensors']} tensors ({done['bytes'] / 1e6:,.1f} MB {done['dtype']}) of step {done['step']} "
              f"in {len(done['files'])} file(s) in {done['out']} ({done['seconds']} s)")
        return 0
    if args.ckpt_command == "verify":
        folder = _one_checkpoint(args.path)
        problem = ckpt.verify(folder)
        if problem:
            print(f"damaged: {problem}", file=sys.stderr)
            return 1
        manifest = contract.read_json(folder / contract.MANIFEST)
        print(f"{folder}: good ({len(manifest['files'])} files, sizes and sha256 as the manifest says)")
        return 0
    path, owner = _ckpt_target(home, args.target)
    if args.ckpt_command == "list":
        found = ckpt.find(path, deep=args.deep)
        if args.json:
            print(json.dumps([
                {"task": c.task, "step": c.step, "folder": str(c.folder), "engine": c.engine, "world_size": c.world_size,
                 "size": c.size, "committed": c.committed, "verified": c.verified, "problem": c.problem} for c in found
            ], indent=2))
            return 0
        from rich.table import Table

        t = Table(title=str(path), title_justify="left")
        for col in ("task", "step", "engine", "world", "size", "committed", "verified", "folder"):
            t.add_column(col, overflow="fold")
        for c in found:
            t.add_row(c.task, str(c.step), c.engine or "-", str(c.world_size or "-"), ckpt.human_size(c.size),
                      "yes" if c.committed else "no", "yes" if c.verified else f"no: {c.problem}", c.folder.name)
        _console().print(t)
        return 0
    plan = ckpt.plan_prune(ckpt.find(path), args.keep)
    for c in plan.remove:
        print(f"{'would remove' if args.dry_run else 'removing'} task {c.task} {c.folder.name} ({ckpt.human_size(c.size)})")
    if args.dry_run:
        print(f"dry run: {len(plan.remove)} to remove, {len(plan.keep)} kept; nothing removed")
        return 0
    for c in plan.remove:
        try:
            contract.discard_checkpoint(c.folder)
        except FileNotFoundError:
            continue  # removed meanwhile (the run's own rotation): the same end
        if owner and c.step is not None and c.task.isdigit():
            owner[0].mark_checkpoint(owner[1]["id"], int(c.task), c.step, "PRUNED")
    if owner and plan.remove:
        ledger, exp = owner
        ledger.event(exp["id"], "checkpoint.pruned", f"orchestrate ckpt prune --keep {args.keep}: removed {len(plan.remove)} checkpoint(s)")
    print(f"removed {len(plan.remove)} checkpoint(s), kept {len(plan.keep)}")
    return 0


COMMANDS = {
    "validate": cmd_validate,
    "schema": cmd_schema,
    "plan": cmd_plan,
    "submit": cmd_submit,
    "status": cmd_status,
    "logs": cmd_logs,
    "events": cmd_events,
    "cancel": cmd_cancel,
    "watch": cmd_watch,
    "ckpt": cmd_ckpt,
}
