"""The SLURM executor: every task of an experiment goes out as one job array (several
when the site's limits say so), through submitit.

The batch script is ``slurm_script``'s. Before submitting, ``sbatch --test-only`` runs
it, so a request SLURM would refuse (a missing partition) or leave pending forever
(more nodes than the partition has) is an error at submit time, before anything is
queued.

State comes from one ``squeue`` call per refresh for every live job of every
experiment, and ``sacct`` (all runs, ``-D``) only for the jobs that left the queue or
came back to it; ``slurm_parse`` translates it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pwd
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator import contract
from orchestrator.errors import SchedulerError, UserError
from orchestrator.scheduler import commands
from orchestrator.scheduler.base import Capabilities, JobRef, Observation
from orchestrator.scheduler.site_limits import Room, SiteLimits, Split, parse_config_limits, parse_max_submit, room, split
from orchestrator.scheduler.slurm_parse import SACCT_FIELDS, by_key, history, local_time, observe, parse_job_id, parse_sacct, parse_scontrol_jobs, parse_squeue
from orchestrator.states import AttemptState

if TYPE_CHECKING:
    from orchestrator.scheduler.request import Plan

log = logging.getLogger(__name__)

QUERY_TIMEOUT_S = 30
PYTHON_KEY = "_python"  # in sbatch-parameters.json: the shell words that start Python on the nodes
CHECK_TIMEOUT_S = 60
SQUEUE_FORMAT = "%i|%T|%r|%N|%S"
JOB_COUNT_SHARE = 10  # everyone's jobs are counted for a sweep of at least a tenth of MaxJobCount
LIMITS_TTL_S = 300.0  # a watcher reads the site's limits again after this long (an admin may change them)


class SlurmScheduler:
    name = "slurm"
    capabilities = Capabilities(requeue_in_place=True, requeues_by_itself=True, tells_why_stopped=True, costly_poll=True,
                                evaluation_jobs=True)

    def __init__(self, runner: commands.Runner | None = None):
        self.runner = runner or commands.Runner()
        self.accounting: bool | None = None  # None: not known yet (sacct answers, or says it is disabled)
        self._limits: dict[tuple[str, str], tuple[float, SiteLimits]] = {}

    def preview(self, plan: Plan) -> dict[str, str]:
        from orchestrator.scheduler import slurm_script as script  # the spec's models: imported to submit, not to poll

        if not shutil.which("sbatch"):
            return {"sbatch_script": script.render_batch_script(plan), "slurm_check": "not checked: sbatch is not on PATH here"}
        parts = self.split(plan, watched=True)
        first = len(parts.arrays[0]) if parts.arrays else parts.first
        check = self.check(plan, first) + (f"; {parts.words}; the script of the first array" if parts.words else "")
        return {"sbatch_script": script.render_batch_script(plan, tasks=first), "slurm_check": check}

    def check(self, plan: Plan, tasks: int | None = None) -> str:
        """``sbatch --test-only`` on the plan's script (of its first array, ``tasks`` long, when
        the sweep is split); returns SLURM's estimate or raises SchedulerError with the fix."""
        from orchestrator.scheduler import slurm_script as script  # the spec's models: imported to submit, not to poll

        with tempfile.NamedTemporaryFile("w", suffix=".sbatch", prefix="orchestrate-") as fh:
            fh.write(script.render_batch_script(plan, tasks=tasks))
            fh.flush()
            try:
                out = self.runner.run(["sbatch", "--test-only", fh.name], timeout=CHECK_TIMEOUT_S)
            except commands.CommandError as exc:
                if exc.returncode is None:
                    raise SchedulerError(f"cannot reach SLURM: {exc}") from None
                raise SchedulerError(script.explain_refusal(exc.stderr + exc.stdout, plan)) from None
        return " ".join((out.stderr + out.stdout).split()).removeprefix("sbatch: ")

    def site_limits(self, qos: str | None, account: str | None = None) -> SiteLimits:
        """What the site caps (read once per submission, and by a watcher every LIMITS_TTL_S);
        a limit SLURM does not tell is None."""
        key = (qos or "", account or "")
        cached = self._limits.get(key)
        if cached and time.monotonic() - cached[0] < LIMITS_TTL_S:
            return cached[1]
        try:
            config = parse_config_limits(self.runner.query(["scontrol", "show", "config"], timeout=QUERY_TIMEOUT_S).stdout)
        except commands.CommandError:
            config = {}
        max_submit = None
        try:
            user = pwd.getpwuid(os.getuid()).pw_name
            where = [f"user={user}"] + ([f"cluster={config['ClusterName']}"] if config.get("ClusterName") else [])
            where += [f"account={account}"] if account else []
            assoc = self.runner.query(["sacctmgr", "-n", "-P", "show", "assoc", "where", *where, "format=MaxSubmit"],
                                      timeout=QUERY_TIMEOUT_S).stdout
            # a QOS only when the spec names it: the user's default QOS is the association's business
            qos_text = self.runner.query(["sacctmgr", "-n", "-P", "show", "qos", "format=Name,MaxSubmitPU"],
                                         timeout=QUERY_TIMEOUT_S).stdout if qos else ""
            max_submit = parse_max_submit(assoc, qos_text, qos or "")
        except (commands.CommandError, KeyError):
            pass  # no accounting, or sacctmgr not here: SLURM refuses at sbatch if it has a limit
        limits = SiteLimits(config.get("MaxArraySize"), config.get("MaxJobCount"), max_submit)
        self._limits[key] = (time.monotonic(), limits)
        return limits

    def room_for(self, limits: SiteLimits, wanted: int | None = None) -> Room:
        """Jobs SLURM takes now under ``limits``: one squeue of the user's jobs, and one of
        everyone's only where ``wanted`` jobs are a fair part of MaxJobCount (every cluster has
        one, 10,000 by default: a small sweep fits unless the controller is full, and then
        sbatch says so); no call at all when the site sets no limit."""
        count_all = limits.max_job_count is not None and (wanted is None or wanted * JOB_COUNT_SHARE >= limits.max_job_count)
        if limits.max_submit is None and not count_all:
            return room(limits, 0, None)
        mine = len(self.runner.query(["squeue", "-h", "-r", "--me", "-o", "%i"], timeout=QUERY_TIMEOUT_S).stdout.split())
        everyone = None
        if count_all:
            everyone = len(self.runner.query(["squeue", "-h", "-r", "-o", "%i"], timeout=QUERY_TIMEOUT_S).stdout.split())
        return room(limits, mine, everyone)

    def queue_room(self, run_dir: Path, wanted: int) -> Room:
        params = contract.read_json(params_path(run_dir)) or {}
        qos, account = (p if isinstance(p, str) else None for p in (params.get("qos"), params.get("account")))
        return self.room_for(self.site_limits(qos, account), wanted)

    def split(self, plan: Plan, watched: bool) -> Split:
        """The plan's tasks as the arrays the site takes now, and those that wait for room in
        the queue; refuses a sweep that does not fit when no watcher would submit the rest."""
        limits = self.site_limits(plan.resources.qos, plan.resources.account)
        return split(len(plan.tasks), limits, self.room_for(limits, len(plan.tasks)), plan.max_parallel, watched)

    def submit(self, plan: Plan, watched: bool = False) -> dict[int, str]:
        import submitit

        from orchestrator.scheduler import slurm_script as script  # the spec's models: imported to submit, not to poll
        from submitit.core.utils import FailedJobError

        from train_entry.agent import submitit_entry

        parts = self.split(plan, watched)
        self.check(plan, len(parts.arrays[0]) if parts.arrays else parts.first)  # also fails fast, with a timeout, when the controller does not answer
        python = script.python_command(plan)
        try:
            executor = submitit.SlurmExecutor(folder=script.submitit_folder(plan), python=python)
        except RuntimeError:
            raise UserError("SLURM's `srun` is not on PATH on this machine; use --executor local, or load SLURM first") from None
        params = script.batch_parameters(plan)
        # what a resubmission of one task, and the watcher's submission of waiting ones, reuse
        contract.atomic_write_json(params_path(plan.run_dir), {**params, PYTHON_KEY: python})
        tasks = sorted(plan.tasks, key=lambda t: t.index)
        out: dict[int, str] = {}
        arrays: list[str] = []
        try:
            for chunk in parts.arrays:
                part = [tasks[i] for i in chunk]
                extra = dict(params["additional_parameters"])
                if arrays and plan.max_parallel:
                    # one max_parallel budget across arrays: each array starts once the one before ended
                    # (and after whatever the spec's own dependency waits for: ',' is AND)
                    extra["dependency"] = after_job(extra, arrays[-1])
                executor.update_parameters(**{**params, "array_parallelism": min(params["array_parallelism"], len(part)),
                                              "additional_parameters": extra})
                jobs = executor.map_array(submitit_entry, [str(t.task_dir) for t in part])
                arrays.append(parse_job_id(jobs[0].job_id).job)
                out.update({t.index: job.job_id for t, job in zip(part, jobs)})
        except BaseException as exc:
            if arrays:  # all or nothing: the arrays already queued go too
                try:
                    self.runner.run(["scancel", *arrays], timeout=QUERY_TIMEOUT_S, check=False)
                except commands.CommandError as cancel_exc:
                    log.warning("could not cancel the arrays already queued (%s): %s", ", ".join(arrays), cancel_exc)
            if isinstance(exc, FailedJobError):
                raise SchedulerError(script.explain_refusal(str(exc), plan)) from None
            raise
        return out

    def submit_tasks(self, run_dir: Path, indices: list[int], max_parallel: int | None, after: str | None, tag: str) -> dict[int, str]:
        """Tasks that waited for room in the queue, as one array with the experiment's own
        request (named with ``tag``; after job ``after`` when one max_parallel budget chains them)."""
        from submitit.core.utils import FailedJobError

        from train_entry.agent import submitit_entry

        def adjust(params: dict) -> None:
            params["array_parallelism"] = min(max_parallel or len(indices), len(indices))
            extra = params.setdefault("additional_parameters", {})
            if after:
                extra["dependency"] = after_job(extra, after)

        executor = saved_executor(run_dir, tag, adjust)
        try:
            jobs = executor.map_array(submitit_entry, [str(contract.task_dir(run_dir, i)) for i in indices])
        except FailedJobError as exc:
            # transient as a rule (another job of the user took the room first): the watcher tries again
            raise SchedulerError(f"SLURM refused the waiting tasks' array: {' '.join(str(exc).split())[:400]}") from None
        return {i: job.job_id for i, job in zip(indices, jobs)}

    def poll(self, refs: list[JobRef]) -> dict[str, Observation]:
        """squeue first (the controller's live view, one RPC for every job); then accounting
        (slurmdbd, the costly call) only for the jobs that left the queue, or that are pending
        again after they ran (their earlier runs tell why they were requeued)."""
        if not refs:
            return {}
        keys = [r.job_id for r in refs]
        shown = self.runner.query(["squeue", "-h", "-r", "--me", "-o", SQUEUE_FORMAT], timeout=QUERY_TIMEOUT_S)
        queue = parse_squeue(shown.stdout)
        queued = by_key(queue)
        ask = [r for r in refs if r.job_id not in queued or queued[r.job_id].state.ended  # how it ended: exit code, cause
               or (r.started and queued[r.job_id].state == AttemptState.PENDING)]
        records = []
        if ask and self.accounting is not False:
            try:
                jobs = sorted({parse_job_id(r.job_id).job for r in ask}, key=int)
                sacct = self.runner.query(
                    ["sacct", "-D", "-X", "-n", "-P", "--format=" + ",".join(SACCT_FIELDS), *since_args(ask), "-j", ",".join(jobs)],
                    timeout=QUERY_TIMEOUT_S,
                )
                records, self.accounting = parse_sacct(sacct.stdout), True
            except commands.CommandError as exc:
                if NO_ACCOUNTING not in exc.stderr + exc.stdout:
                    raise
                self.accounting = False  # this cluster has none: it will not come back while we run
        if ask and self.accounting is False:  # what the controller still holds of ended jobs (MinJobAge), and the agents' records
            records = parse_scontrol_jobs(self.runner.query(["scontrol", "show", "job", "-o"], timeout=QUERY_TIMEOUT_S).stdout)
        out = observe(records, queue, keys, user_of=_user_name, complete=self.accounting is not False)
        if self.accounting is False:
            out = {k: dataclasses.replace(o, history=False) for k, o in out.items()}
            out.update(lost(refs, out, time.time()))
        return out

    def allocations(self, job_ids: list[str]) -> dict[str, list[tuple[float, float | None, int]]]:
        """SLURM's own account of each run of these jobs (sacct -D: a requeued job has one a
        run), oldest first: (start, end or None while running, nodes). Empty without
        accounting; the report then uses its agents' records."""
        jobs = sorted({parse_job_id(j).job for j in job_ids if j}, key=int)
        if not jobs or self.accounting is False:
            return {}
        try:
            out = self.runner.query(["sacct", "-D", "-X", "-n", "-P", "--format=" + ",".join(SACCT_FIELDS), "-j", ",".join(jobs)],
                                    timeout=QUERY_TIMEOUT_S)
        except commands.CommandError as exc:
            if NO_ACCOUNTING in exc.stderr + exc.stdout:
                return {}
            raise
        runs: dict[str, list[tuple[float, float | None, int]]] = {}
        for key, records in history(parse_sacct(out.stdout)).items():
            for r in records:
                start = local_time(r.start or "")
                if start is not None:
                    runs.setdefault(key, []).append((start, local_time(r.end or ""), len(r.nodes)))
        return runs

    def cancel(self, refs: list[JobRef]) -> None:
        if refs:
            self.runner.query(["scancel", *sorted({r.job_id for r in refs})], timeout=QUERY_TIMEOUT_S)

    # ------------------------------------------------------------ recovery

    def requeue(self, job_id: str) -> bool:
        """Put an ended (or running) job back in the queue under its id; False when SLURM
        no longer holds its record (then only a new submission will do)."""
        try:
            self.runner.run(["scontrol", "requeue", job_id], timeout=QUERY_TIMEOUT_S)
        except commands.CommandError as exc:
            said = exc.stderr + exc.stdout
            if "Invalid job id" in said:
                return False
            if "pending" in said.lower():  # already back in the queue: done before we asked
                return True
            raise
        return True

    def release(self, job_id: str, exclude: list[str], delay_s: float) -> None:
        """A requeued job: keep it off failed nodes, and hold it ``delay_s`` (the backoff)."""
        argv = ["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{max(0, int(delay_s))}"]
        if exclude:
            argv.append(f"ExcNodeList={','.join(sorted(exclude))}")
        self.runner.run(argv, timeout=QUERY_TIMEOUT_S)

    def set_exclude(self, job_id: str, exclude: list[str]) -> None:
        """A pending job's excluded nodes, replaced (``ExcNodeList=`` clears them)."""
        self.runner.run(["scontrol", "update", f"JobId={job_id}", f"ExcNodeList={','.join(sorted(exclude))}"], timeout=QUERY_TIMEOUT_S)

    def resubmit(self, run_dir: Path, index: int, exclude: list[str], delay_s: float, tag: str) -> str:
        """One task as a new job, with the experiment's own request; returns its id."""
        from train_entry.agent import submitit_entry

        def adjust(params: dict) -> None:
            params.pop("array_parallelism", None)
            excluded = sorted({*filter(None, str(params.get("exclude") or "").split(",")), *exclude})
            if excluded:
                params["exclude"] = ",".join(excluded)
            params.setdefault("additional_parameters", {})["begin"] = f"now+{max(0, int(delay_s))}"

        return saved_executor(run_dir, tag, adjust).submit(submitit_entry, str(contract.task_dir(run_dir, index))).job_id

    def find_submission(self, run_dir: Path, tag: str, since: float) -> str | None:
        """The job a resubmission with ``tag`` made, if SLURM has it (for a watcher that
        died between submitting and recording)."""
        params = contract.read_json(params_path(run_dir)) or {}
        name = f"{params.get('job_name', '')}-{tag}"
        out = self.runner.query(["squeue", "-h", "--me", "-n", name, "-o", "%i"], timeout=QUERY_TIMEOUT_S).stdout.split()
        if not out and self.accounting is not False:
            start = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(since - 60))
            out = self.runner.query(
                ["sacct", "-X", "-n", "-P", "-S", start, "--name", name, "-o", "JobID"], timeout=QUERY_TIMEOUT_S
            ).stdout.split()
        return out[0] if out else None

    def find_tasks(self, run_dir: Path, tag: str, since: float, indices: list[int]) -> dict[int, str]:
        job = self.find_submission(run_dir, tag, since)
        if job is None:
            return {}
        array = parse_job_id(job).job  # array task k is the k-th of ``indices``, as submit_tasks sent them
        return {idx: f"{array}_{k}" for k, idx in enumerate(indices)}

    def submit_evaluation(self, run_dir: Path, args: list[str], cwd: str, log: Path, resources, minutes: float, tag: str) -> str:
        """An evaluation of a checkpoint as its own job (``slurm_eval``); its id."""
        from orchestrator.scheduler.slurm_eval import submit_evaluation

        return submit_evaluation(run_dir, args, cwd, log, resources, minutes, tag)

    def node_states(self) -> dict[str, str]:
        """Every node's state (``sinfo``): failed nodes are excluded from recovered tasks."""
        out = self.runner.query(["sinfo", "-h", "-N", "-o", "%N|%T"], timeout=QUERY_TIMEOUT_S).stdout
        return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)


def after_job(extra: dict, job: str) -> str:
    """The dependency of a chained array: after ``job`` has ended, and after whatever the
    spec's own dependency waits for (',' is AND)."""
    return ",".join(filter(None, [str(extra.get("dependency") or ""), f"afterany:{job}"]))


def saved_executor(run_dir: Path, tag: str, adjust):
    """submitit's executor with the experiment's own request as submit saved it (named with
    ``tag``), changed by ``adjust``; checked again, since the file may have been edited since."""
    import submitit

    from orchestrator.scheduler import slurm_script as script

    params = contract.read_json(params_path(run_dir))
    if params is None:
        raise SchedulerError(f"cannot submit: {params_path(run_dir)} is missing")
    python = script.python_words(params.pop(PYTHON_KEY, None))
    params["job_name"] = f"{params['job_name']}-{tag}"
    adjust(params)
    script.check_parameters(params, Path(run_dir) / "submitit")
    executor = submitit.SlurmExecutor(folder=Path(run_dir) / "submitit", python=python)
    executor.update_parameters(**params)
    return executor


NO_ACCOUNTING = "accounting storage is disabled"  # sacct's words on a cluster without slurmdbd
LOST_GRACE_S = 120.0


def lost(refs: list[JobRef], seen: dict[str, Observation], now: float) -> dict[str, Observation]:
    """Without accounting, a job that squeue and scontrol no longer know (its record aged out
    of the controller, or the controller lost it) is LOST once it was submitted more than
    LOST_GRACE_S ago; the agents' end records still decide when they exist."""
    return {
        r.job_id: Observation(r.job_id, AttemptState.LOST, None, "SLURM has no record of the job and there is no accounting to ask")
        for r in refs
        if r.job_id not in seen and r.submitted_at and now - r.submitted_at > LOST_GRACE_S
    }


def params_path(run_dir: Path) -> Path:
    return Path(run_dir) / "submitit" / "sbatch-parameters.json"


def since_args(refs: list[JobRef], margin_s: float = 3600) -> list[str]:
    """``-S`` for sacct: only jobs active since shortly before the oldest submission, so an
    old job that carried the same id (a controller restarted clean) is not taken for ours."""
    times = [r.submitted_at for r in refs if r.submitted_at]
    if len(times) != len(refs) or not times:
        return []
    return ["-S", time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(min(times) - margin_s))]


def _user_name(uid: str) -> str:
    try:
        return pwd.getpwuid(int(uid)).pw_name
    except (KeyError, ValueError):
        return f"uid {uid}"
