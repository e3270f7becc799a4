"""The SLURM executor: every task of an experiment goes out as one job array.

submitit writes the batch script, pickles the call and runs it on the nodes: each
array task asks for ``resources.nodes`` nodes and runs one node agent per node
(``srun`` with one task per node), and the agent starts the ranks. So the sbatch
request is per node: ``cpus-per-task`` is the CPUs of all ranks on a node and
``gpus-per-node`` their GPUs.

The batch script is a pure function of the plan (``render_batch_script``): it is
what ``submit --dry-run`` prints and what goldens pin, and a test checks that it
is the very file submitit hands to sbatch. Before submitting, ``sbatch
--test-only`` runs that script, so a request SLURM would refuse (a missing
partition) or leave pending forever (more nodes than the partition has) is an
error at submit time, before anything is queued.

State comes from one ``sacct`` call (all runs, ``-D``) and one ``squeue`` call per
refresh for every live job of every experiment; ``slurm_parse`` translates it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pwd
import re
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from orchestrator import contract
from orchestrator.errors import SchedulerError, UserError
from orchestrator.scheduler import commands
from orchestrator.scheduler.base import Capabilities, JobRef, Observation
from orchestrator.scheduler.site_limits import Room, SiteLimits, Split, parse_config_limits, parse_max_submit, room, split
from orchestrator.scheduler.slurm_parse import SACCT_FIELDS, observe, parse_job_id, parse_sacct, parse_scontrol_jobs, parse_squeue
from orchestrator.states import AttemptState
from orchestrator.spec import slurmtext
from orchestrator.spec.units import parse_memory_mb
from orchestrator.submit import fragments
from orchestrator.submit.plan import Plan

log = logging.getLogger(__name__)

QUERY_TIMEOUT_S = 30
PYTHON_KEY = "_python"  # in sbatch-parameters.json: the shell words that start Python on the nodes
CHECK_TIMEOUT_S = 60
SQUEUE_FORMAT = "%i|%T|%r|%N|%S"
LIMITS_TTL_S = 300.0  # a watcher reads the site's limits again after this long (an admin may change them)


def submitit_folder(plan: Plan) -> Path:
    return plan.run_dir / "submitit"


def batch_parameters(plan: Plan) -> dict:
    """The plan as submitit's sbatch parameters (the names of submitit's SlurmExecutor)."""
    r = plan.resources
    n = len(plan.tasks)
    ck = plan.spec.checkpoint
    # requeue after preemption or node failure, and a signal before the time limit to save on
    extra: dict = {"requeue": True}
    if ck.signal != "USR2":  # submitit always writes USR2@<delay>; another signal overrides it
        extra["signal"] = f"{ck.signal}@{ck.signal_before_s}"
    if r.mem:
        extra["mem"] = f"{parse_memory_mb(r.mem)}M"
    for key, value in r.sbatch_extra.items():
        if value is not False:
            extra[key.lstrip("-")] = value
    params = {
        "job_name": f"{plan.name}-{plan.experiment_id}",
        "time": max(1, math.ceil(r.time_seconds / 60)),
        "nodes": r.nodes,
        "ntasks_per_node": 1,  # the node agent; it starts tasks_per_node ranks
        "cpus_per_task": r.cpus_per_task * r.tasks_per_node,
        "gpus_per_node": r.gpus_per_task * r.tasks_per_node or None,
        "partition": r.partition,
        "account": r.account,
        "qos": r.qos,
        "constraint": r.constraint,
        "exclude": ",".join(r.exclude) or None,
        "comment": f"orchestrate {plan.experiment_id}",
        "wckey": "orchestrate",
        "array_parallelism": min(plan.max_parallel or n, n),
        "stderr_to_stdout": True,
        "signal_delay_s": plan.spec.checkpoint.signal_before_s,
        # one failed node agent ends the step: the others' ranks would only hang
        "srun_args": ["--kill-on-bad-exit=1", *container_srun_args(plan), *r.srun_args],
        "additional_parameters": extra,
    }
    params = {k: v for k, v in params.items() if v is not None}
    check_parameters(params, submitit_folder(plan))  # before the fragments, so that a refusal names the spec field
    params["setup"] = setup_lines(plan)
    return check_parameters(params, submitit_folder(plan))


def container_mounts(plan: Plan) -> list[str]:
    """What a container must see at the same paths: the run folder, the folders of the
    files the spec names (for every sweep task), then ``container.mounts``."""
    paths = [str(plan.run_dir)]
    for spec in [plan.spec, *(t.spec for t in plan.tasks if t.spec is not None)]:
        model, data = spec.model, spec.data
        for section, key in ((model, "path"), (data, "path"), (data, "eval_path"), (model, "script"), (model, "cwd")):
            value = getattr(section, key, None)
            if isinstance(value, str) and value.startswith("/"):
                paths.append(value if key in ("cwd",) or os.path.isdir(value) else os.path.dirname(value))
    for p in paths:
        try:
            slurmtext.mount_text(p)
        except ValueError as exc:
            raise UserError(f"resources.container: cannot mount {exc}; move it to a path without ',' "
                            "or mount its folder yourself with container.mounts") from None
    return list(dict.fromkeys([*paths, *plan.resources.container.mounts]))


def container_srun_args(plan: Plan) -> list[str]:
    """pyxis: srun runs the step in the image."""
    c = plan.resources.container
    if c is None or c.runtime != "pyxis":
        return []
    return [f"--container-image={c.image}", f"--container-mounts={','.join(container_mounts(plan))}"]


def python_command(plan: Plan, python: str = sys.executable) -> str:
    """The shell words that start Python on the nodes (submitit's ``python``): this
    interpreter, or the image's through Apptainer/Singularity; every word shell-quoted."""
    c = plan.resources.container
    if c is None:
        return shlex.quote(python)
    if c.runtime == "pyxis":
        return shlex.quote(c.python)
    gpu = ["--nv"] if plan.resources.gpus_per_task else []
    return shlex.join([c.runtime, "exec", *gpu, "--bind", ",".join(container_mounts(plan)), c.image, c.python])


def setup_lines(plan: Plan) -> list[str]:
    """The batch script's setup: common.sh, the named fragments, then resources.setup."""
    values = {"name": plan.name, "experiment_id": plan.experiment_id, "run_dir": str(plan.run_dir)}  # render quotes them
    lines = fragments.render(fragments.COMMON, values)
    for name in plan.resources.setup_templates:
        lines += fragments.render(name, values)
    if plan.resources.setup:
        lines += ["# --- resources.setup", *plan.resources.setup]
    return lines


# where each sbatch parameter comes from, for the error that refuses it
_SOURCE = {
    "job_name": "name",
    "partition": "resources.partition",
    "account": "resources.account",
    "qos": "resources.qos",
    "constraint": "resources.constraint",
    "exclude": "resources.exclude",
    "additional_parameters": "resources.sbatch_extra",
    "srun_args": "resources.srun_args",
    "setup": "resources.setup",
}


def check_parameters(params: dict, folder: Path) -> dict:
    """The last check before submitit writes the script: no value may end its
    ``#SBATCH`` line or read differently to sbatch and bash (submitit quotes values
    with shlex.quote and writes option names as they are). The spec refuses all of
    this already; here it catches values that never went through a spec (an edited
    sbatch-parameters.json, a run folder under an odd current directory)."""
    try:
        slurmtext.path_text(str(folder))  # in the log paths of --output/--error
    except ValueError as exc:
        raise UserError(f"refusing to write the batch script: the run folder (workdir): {exc}") from None
    for key, value in params.items():
        try:
            _check_parameter(key, value)
        except ValueError as exc:
            where = _SOURCE.get(key, f"sbatch parameter {slurmtext.shown(key)}")
            raise UserError(f"refusing to write the batch script: {where}: {exc}") from None
    return params


def _check_parameter(key: str, value) -> None:
    if key == "additional_parameters":
        for option, v in value.items():
            slurmtext.directive_text(option)
            if not slurmtext.OPTION_NAME.fullmatch(option.replace("_", "-")):  # submitit turns _ into -
                raise ValueError(f"{slurmtext.shown(option)} is not an sbatch option name")
            if isinstance(v, str):
                slurmtext.directive_text(v)
    elif key == "srun_args":  # argv of srun, shell-quoted by submitit
        for arg in value:
            slurmtext.argv_element(arg)
    elif key == "setup":  # shell lines, the user's own by design
        for line in value:
            slurmtext.no_nul(line)
    elif isinstance(value, str):
        slurmtext.directive_text(value)


def submit_command(python: str, folder: Path) -> str:
    """The command submitit puts in the batch script (as its SlurmExecutor does);
    ``python``: shell words, quoted already (``python_command``)."""
    return " ".join([python, "-u -m submitit.core._submit", shlex.quote(str(folder))])


def render_batch_script(plan: Plan, python: str = sys.executable, tasks: int | None = None) -> str:
    """The exact batch script of the plan's job array (a single job for one task,
    as submitit submits it); ``tasks``: of an array of that many (a sweep split to fit MaxArraySize)."""
    from submitit.slurm.slurm import _make_sbatch_string

    n = len(plan.tasks) if tasks is None else tasks
    params = batch_parameters(plan)
    params["array_parallelism"] = min(params["array_parallelism"], n)
    return _make_sbatch_string(
        command=submit_command(python_command(plan, python), submitit_folder(plan)),
        folder=submitit_folder(plan),
        map_count=n if n > 1 else None,
        **params,
    )


# ---------------------------------------------------------------- refusals, in the spec's words

_HINTS = (
    ("Invalid partition", "resources.partition: SLURM has no partition '{partition}'; `sinfo -s` lists the partitions"),
    (
        "Requested node configuration is not available",
        "no nodes of partition '{partition}' can give each task {nodes} node(s) with {cpus} CPU(s){mem}{gpus} per node; "
        "check resources.nodes, tasks_per_node, cpus_per_task, gpus_per_task, mem, constraint and exclude "
        "against `sinfo -o '%P %D %c %m %G %f'`",
    ),
    ("Node count specification invalid", "resources.nodes: the partition cannot give {nodes} node(s)"),
    ("Invalid account", "resources.account: SLURM does not know account '{account}' (or you may not use it); `sacctmgr show assoc user=$USER`"),
    ("Invalid qos", "resources.qos: SLURM does not know QOS '{qos}' (or you may not use it)"),
    ("Invalid feature specification", "resources.constraint: no node has the feature(s) '{constraint}'"),
    ("Invalid generic resource", "resources.gpus_per_task: this partition has no GPUs (gres) to give"),
    ("time limit", "resources.time: {time} is over the partition's limit"),
)


# words of SLURM's clients that mean "no controller here", not "your request is wrong"
_UNREACHABLE = ("configuration source", "Unable to process configuration", "Unable to contact slurm controller")


def explain_refusal(stderr: str, plan: Plan) -> str:
    """SLURM's words for a refused request, and which spec field to change."""
    r = plan.resources
    words = [l.removeprefix("sbatch: error: ").removeprefix("sbatch: fatal: ").strip() for l in stderr.splitlines() if l.strip()]
    said = "; ".join(dict.fromkeys(words)) or "no reason given"
    if any(w in stderr for w in _UNREACHABLE):
        return (
            f"cannot reach SLURM from here: {said}\n"
            "  check SLURM_CONF and `scontrol ping`, or run on this machine with --executor local"
        )
    facts = {
        "partition": r.partition or "(the default)",
        "nodes": r.nodes,
        "cpus": r.cpus_per_task * r.tasks_per_node,
        "mem": f", {r.mem} memory" if r.mem else "",
        "gpus": f", {r.gpus_per_task * r.tasks_per_node} GPU(s)" if r.gpus_per_task else "",
        "account": r.account,
        "qos": r.qos,
        "constraint": r.constraint,
        "time": r.time,
    }
    hints = [h.format(**facts) for key, h in _HINTS if key.lower() in stderr.lower()]
    return f"SLURM refuses the job array: {said}" + "".join(f"\n  {h}" for h in hints)


class SlurmScheduler:
    name = "slurm"
    capabilities = Capabilities(requeue_in_place=True, requeues_by_itself=True, tells_why_stopped=True)

    def __init__(self, runner: commands.Runner | None = None):
        self.runner = runner or commands.Runner()
        self.accounting: bool | None = None  # None: not known yet (sacct answers, or says it is disabled)
        self._limits: dict[tuple[str, str], tuple[float, SiteLimits]] = {}

    def preview(self, plan: Plan) -> dict[str, str]:
        if not shutil.which("sbatch"):
            return {"sbatch_script": render_batch_script(plan), "slurm_check": "not checked: sbatch is not on PATH here"}
        parts = self.split(plan, watched=True)
        first = len(parts.arrays[0]) if parts.arrays else len(plan.tasks)
        check = self.check(plan, first) + (f"; {parts.words}; the script of the first array" if parts.words else "")
        return {"sbatch_script": render_batch_script(plan, tasks=first), "slurm_check": check}

    def check(self, plan: Plan, tasks: int | None = None) -> str:
        """``sbatch --test-only`` on the plan's script (of its first array, ``tasks`` long, when
        the sweep is split); returns SLURM's estimate or raises SchedulerError with the fix."""
        with tempfile.NamedTemporaryFile("w", suffix=".sbatch", prefix="orchestrate-") as fh:
            fh.write(render_batch_script(plan, tasks=tasks))
            fh.flush()
            try:
                out = self.runner.run(["sbatch", "--test-only", fh.name], timeout=CHECK_TIMEOUT_S)
            except commands.CommandError as exc:
                if exc.returncode is None:
                    raise SchedulerError(f"cannot reach SLURM: {exc}") from None
                raise SchedulerError(explain_refusal(exc.stderr + exc.stdout, plan)) from None
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

    def room_for(self, limits: SiteLimits) -> Room:
        """Jobs SLURM takes now under ``limits``: one squeue of the user's jobs (and one of
        everyone's where MaxJobCount is known); no call at all when the site sets no limit."""
        if limits.max_submit is None and limits.max_job_count is None:
            return room(limits, 0, None)
        mine = len(self.runner.query(["squeue", "-h", "-r", "--me", "-o", "%i"], timeout=QUERY_TIMEOUT_S).stdout.split())
        everyone = None
        if limits.max_job_count is not None:
            everyone = len(self.runner.query(["squeue", "-h", "-r", "-o", "%i"], timeout=QUERY_TIMEOUT_S).stdout.split())
        return room(limits, mine, everyone)

    def queue_room(self, run_dir: Path) -> Room:
        params = contract.read_json(params_path(run_dir)) or {}
        qos, account = (p if isinstance(p, str) else None for p in (params.get("qos"), params.get("account")))
        return self.room_for(self.site_limits(qos, account))

    def split(self, plan: Plan, watched: bool) -> Split:
        """The plan's tasks as the arrays the site takes now, and those that wait for room in
        the queue; refuses a sweep that does not fit when no watcher would submit the rest."""
        limits = self.site_limits(plan.resources.qos, plan.resources.account)
        return split(len(plan.tasks), limits, self.room_for(limits), plan.max_parallel, watched)

    def submit(self, plan: Plan, watched: bool = False) -> dict[int, str]:
        import submitit
        from submitit.core.utils import FailedJobError

        from train_entry.agent import submitit_entry

        parts = self.split(plan, watched)
        self.check(plan, len(parts.arrays[0]) if parts.arrays else None)  # also fails fast when the controller does not answer
        python = python_command(plan)
        try:
            executor = submitit.SlurmExecutor(folder=submitit_folder(plan), python=python)
        except RuntimeError:
            raise UserError("SLURM's `srun` is not on PATH on this machine; use --executor local, or load SLURM first") from None
        params = batch_parameters(plan)
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
                    extra["dependency"] = ",".join(filter(None, [str(extra.get("dependency") or ""), f"afterany:{arrays[-1]}"]))
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
                raise SchedulerError(explain_refusal(str(exc), plan)) from None
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
                extra["dependency"] = ",".join(filter(None, [str(extra.get("dependency") or ""), f"afterany:{after}"]))

        executor = _saved_executor(run_dir, tag, adjust)
        try:
            jobs = executor.map_array(submitit_entry, [str(contract.task_dir(run_dir, i)) for i in indices])
        except FailedJobError as exc:
            # transient as a rule (another job of the user took the room first): the watcher tries again
            raise SchedulerError(f"SLURM refused the waiting tasks' array: {' '.join(str(exc).split())[:400]}") from None
        return {i: job.job_id for i, job in zip(indices, jobs)}

    def poll(self, refs: list[JobRef]) -> dict[str, Observation]:
        if not refs:
            return {}
        keys = [r.job_id for r in refs]
        jobs = sorted({parse_job_id(k).job for k in keys}, key=int)
        records = None
        if self.accounting is not False:
            try:
                sacct = self.runner.query(
                    ["sacct", "-D", "-X", "-n", "-P", "--format=" + ",".join(SACCT_FIELDS), *since_args(refs), "-j", ",".join(jobs)],
                    timeout=QUERY_TIMEOUT_S,
                )
                records, self.accounting = parse_sacct(sacct.stdout), True
            except commands.CommandError as exc:
                if NO_ACCOUNTING not in exc.stderr + exc.stdout:
                    raise
                self.accounting = False  # this cluster has none: it will not come back while we run
        if records is None:  # what the controller still holds of ended jobs (MinJobAge), and the agents' records
            shown = self.runner.query(["scontrol", "show", "job", "-o"], timeout=QUERY_TIMEOUT_S)
            records = parse_scontrol_jobs(shown.stdout)
        squeue = self.runner.query(["squeue", "-h", "-r", "--me", "-o", SQUEUE_FORMAT], timeout=QUERY_TIMEOUT_S)
        out = observe(records, parse_squeue(squeue.stdout), keys, user_of=_user_name, complete=self.accounting is not False)
        if self.accounting is False:
            out = {k: dataclasses.replace(o, history=False) for k, o in out.items()}
            out.update(lost(refs, out, time.time()))
        return out

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

        return _saved_executor(run_dir, tag, adjust).submit(submitit_entry, str(contract.task_dir(run_dir, index))).job_id

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

    def node_states(self) -> dict[str, str]:
        """Every node's state (``sinfo``): failed nodes are excluded from recovered tasks."""
        out = self.runner.query(["sinfo", "-h", "-N", "-o", "%N|%T"], timeout=QUERY_TIMEOUT_S).stdout
        return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)


def _saved_executor(run_dir: Path, tag: str, adjust):
    """submitit's executor with the experiment's own request as submit saved it (named with
    ``tag``), changed by ``adjust``; checked again, since the file may have been edited since."""
    import submitit

    params = contract.read_json(params_path(run_dir))
    if params is None:
        raise SchedulerError(f"cannot submit: {params_path(run_dir)} is missing")
    python = _python_words(params.pop(PYTHON_KEY, None))
    params["job_name"] = f"{params['job_name']}-{tag}"
    adjust(params)
    check_parameters(params, Path(run_dir) / "submitit")
    executor = submitit.SlurmExecutor(folder=Path(run_dir) / "submitit", python=python)
    executor.update_parameters(**params)
    return executor


def _python_words(text) -> str:
    """The saved Python command, as plain words again (never shell syntax); this
    interpreter when the file has none (written before containers) or a damaged one."""
    try:
        words = shlex.split(text) if isinstance(text, str) else []
        for w in words:
            slurmtext.argv_element(w)
    except ValueError:
        words = []
    return shlex.join(words) if words else shlex.quote(sys.executable)


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
