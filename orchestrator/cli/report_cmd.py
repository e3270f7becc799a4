"""report: the experiment's page (or its figures as JSON), from the ledger and the run folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from orchestrator import contract
from orchestrator.errors import UserError
from orchestrator.ledger import access
from orchestrator.supervise import refresh

log = logging.getLogger(__name__)


def _slurm_runs(ledger, exp: dict) -> dict:
    """SLURM's account of the experiment's jobs, one sacct call; {} where it has none (the
    agents' records stand in)."""
    if exp["executor"] != "slurm":
        return {}
    from orchestrator.errors import SchedulerError
    from orchestrator.scheduler import get_scheduler
    from orchestrator.scheduler.commands import CommandError

    try:
        return get_scheduler("slurm").allocations([a["job_id"] for a in ledger.attempts(exp["id"]) if a.get("job_id")])
    except (CommandError, SchedulerError) as exc:
        log.warning("sacct did not answer (%s): the allocation is the agents' records", exc)
        return {}


def cmd_report(args) -> int:
    from orchestrator.report.document import experiment_report

    ledger = access.open_ledger(access.home_dir(args.home))
    exp = access.resolve_experiment(ledger, args.experiment)[0]
    refresh.for_reader(ledger, [exp])
    mtbf_s = None
    if args.mtbf is not None:
        from orchestrator.spec.units import parse_duration_s

        try:
            mtbf_s = parse_duration_s(args.mtbf)
        except ValueError as exc:
            raise UserError(f"--mtbf: {exc}") from None
    doc = experiment_report(ledger, ledger.experiment(exp["id"]), slurm_runs=_slurm_runs(ledger, exp), mtbf_s=mtbf_s)
    if args.json:
        print(json.dumps(doc, indent=2, allow_nan=False))
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError("the HTML report draws its plots with matplotlib, which is not installed: "
                        "pip install 'orchestrate[report]' (or use --json)") from None
    from orchestrator.report.html import projection_line, render

    out = Path(args.out).expanduser() if args.out else Path(exp["run_dir"]) / "report.html"
    if out.is_dir():
        raise UserError(f"--out {out} is a folder: name the file to write, e.g. {out / 'report.html'}")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: its folder {out.parent} does not exist")
    contract.atomic_write_text(out, render(doc))
    print(f"wrote {out}")
    if doc.get("projection"):
        print(projection_line(doc["projection"]))
    return 0
