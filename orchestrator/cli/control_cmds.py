"""cancel, watch: the commands that act on running experiments."""

from __future__ import annotations

import shlex
import sys

from orchestrator import contract
from orchestrator.cli import render
from orchestrator.cli.follow import follow_experiment
from orchestrator.contract import envvars
from orchestrator.errors import UserError
from orchestrator.ledger import access
from orchestrator.scheduler import commands
from orchestrator.supervise import cancel, loop


def cmd_cancel(args) -> int:
    ledger = access.open_ledger(access.home_dir(args.home))
    exp = access.resolve_experiment(ledger, args.experiment)[0]
    done = cancel.cancel(ledger, exp, args.task)
    evaluations = cancel.stop_evaluations(ledger, exp, args.task)
    if done:
        print(f"cancelling task(s) {', '.join(map(str, done))} of {exp['name']} ({exp['id']})")
    if evaluations:
        print(f"stopping the evaluations of checkpoints of {exp['name']} ({exp['id']}) still due or running")
    if not done and not evaluations:
        print(f"nothing to cancel: no live task in {exp['name']} ({exp['id']}) and no evaluation due or running")
    return 0


def cmd_watch(args) -> int:
    if args.interval <= 0:
        raise UserError("--interval must be positive")
    home = access.home_dir(args.home)
    if args.sbatch:
        return _watch_as_job(args, home)
    ledger = access.open_ledger(home)
    if args.experiment:
        exp = access.resolve_experiment(ledger, args.experiment)[0]
        if args.once:
            loop.watch(ledger, [exp["id"]], args.interval, once=True)
            return 0
        return follow_experiment(ledger, exp["id"], False, args.interval)
    seen: dict[str, int] = {}  # events already printed; history before the watcher started is not repeated

    def show(ids):
        for exp_id in ids:
            events = ledger.events(exp_id)
            start = seen.setdefault(exp_id, 0 if args.once else len(events))
            for e in events[start:]:
                print(f"{exp_id} {render.event_line(e)}", flush=True)
            seen[exp_id] = len(events)

    loop.watch(ledger, None, args.interval, once=args.once, on_cycle=show)
    return 0


def _watch_as_job(args, home) -> int:
    """Submit `orchestrate watch` as a one-CPU SLURM job (the script holds only quoted argv).
    The job's node must see the ledger: only a ledger on a shared (network) filesystem will do."""
    ledger = access.open_ledger(home)
    if not ledger.shared:
        raise UserError(
            f"the watcher job would run on a compute node, which cannot share the ledger in {home} ({ledger.where}: "
            "a disk of this machine, in WAL mode that works on one host only). Set ORCHESTRATE_HOME to a folder on the "
            "shared filesystem the compute nodes see (where workdir is), or run `orchestrate watch` here "
            f"(in tmux or screen). If the compute nodes do see this folder, say so: {envvars.LEDGER_FS}=network."
        )
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
