"""submit: plan, submit every task, and with --dry-run only show what would be submitted."""

from __future__ import annotations

import json
import sys

from orchestrator.cli.follow import follow_experiment
from orchestrator.ledger import access
from orchestrator.scheduler import get_scheduler
from orchestrator.submit import submission
from orchestrator.supervise import leases


def cmd_submit(args) -> int:
    home = access.home_dir(args.home)
    plan = submission.make_plan(args.spec, args.overrides, args.executor, home)
    get_scheduler(plan.executor)  # an unavailable executor is an error before anything is written
    if args.dry_run:
        if args.json:
            print(json.dumps(_dry_run_doc(plan), indent=2))
        else:
            print(_dry_run_text(plan))
        return 0
    ledger = access.open_ledger(home)
    # tasks the queue has no room for may wait only for a watcher: this process, or one that watches every experiment
    job_ids = submission.submit(ledger, plan, watched=args.watch or leases.watching_all(ledger))
    jobs = ", ".join(sorted({j.split("_")[0] for j in job_ids.values()}, key=lambda j: (len(j), j))) or "none yet"
    waiting = len(plan.tasks) - len(job_ids)
    print(f"submitted {plan.name} as {plan.experiment_id}: {len(plan.tasks)} task(s) ({plan.executor}: {jobs})"
          + (f"; {waiting} wait for room in the queue, the watcher submits them as jobs end" if waiting else ""), file=sys.stderr)
    print(f"run folder {plan.run_dir}", file=sys.stderr)
    if not args.watch:
        print(plan.experiment_id)
        return 0
    return follow_experiment(ledger, plan.experiment_id, args.json, args.interval)


def _preview(plan) -> dict[str, str]:
    """The scheduler's part of a dry run; SLURM's check raises SchedulerError when it would refuse."""
    return get_scheduler(plan.executor).preview(plan)


def _dry_run_doc(plan) -> dict:
    return {**plan.summary(), **_preview(plan)}


def _dry_run_text(plan) -> str:
    from orchestrator.submit.plan import render_plan_text

    text = render_plan_text(plan)
    extra = _preview(plan)
    if "sbatch_script" in extra:
        text += "\n\n# the batch script that would be submitted (one job array):\n" + extra["sbatch_script"]
        text += f"\n# sbatch --test-only: {extra['slurm_check']}"
    return text + "\n(dry run: nothing submitted, nothing recorded)"
