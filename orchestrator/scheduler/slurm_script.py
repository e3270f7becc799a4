"""The SLURM batch script of a plan, and SLURM's refusals in the spec's words: pure.

submitit writes the batch script, pickles the call and runs it on the nodes: each
array task asks for ``resources.nodes`` nodes and runs one node agent per node
(``srun`` with one task per node), and the agent starts the ranks. So the sbatch
request is per node: ``cpus-per-task`` is the CPUs of all ranks on a node and
``gpus-per-node`` their GPUs.

The batch script is a pure function of the plan (``render_batch_script``): it is
what ``submit --dry-run`` prints and what goldens pin, and a test checks that it
is the very file submitit hands to sbatch. Every value is checked once more before
it becomes an ``#SBATCH`` line (``check_parameters``).

Apart from ``scheduler/slurm.py`` so that reading SLURM's state (a `status`) never
imports the spec's models.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from pathlib import Path

from orchestrator.errors import UserError
from orchestrator.scheduler import fragments
from orchestrator.scheduler.request import Plan
from orchestrator.spec import slurmtext
from orchestrator.spec.templates import COMMON
from orchestrator.spec.units import parse_memory_mb


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
    extra.update(mail_parameters(plan))
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


# notify.on in SLURM's --mail-type words; SLURM has none for needs_attention. For an array,
# END and FAIL mail once for the whole array (no ARRAY_TASKS: a sweep sends no flood)
MAIL_TYPES = {"failed": "FAIL", "completed": "END", "recovered": "REQUEUE"}


def mail_parameters(plan: Plan) -> dict:
    """notify.email as SLURM's own mail; nothing when `on` names nothing SLURM can tell."""
    n = plan.spec.notify
    types = [MAIL_TYPES[t] for t in n.on if t in MAIL_TYPES] if n is not None and n.email else []
    return {"mail-user": n.email, "mail-type": ",".join(types)} if types else {}


def container_mounts(plan: Plan) -> list[str]:
    """What a container must see at the same paths: the run folder, the folders of the
    files the spec names (for every sweep task), then ``container.mounts``."""
    paths = [str(plan.run_dir)]
    for spec in [plan.spec, *(t.spec for t in plan.tasks if t.spec is not None)]:
        model, data = spec.model, spec.data
        for section, key in ((model, "path"), (data, "path"), (data, "eval_path"), (data, "cache_dir"), (model, "script"), (model, "cwd")):
            value = getattr(section, key, None)
            for one in [value] if isinstance(value, str) else value if isinstance(value, list) else []:  # data paths may be lists
                if isinstance(one, str) and one.startswith("/"):
                    paths.append(one if key in ("cwd", "cache_dir") or os.path.isdir(one) else os.path.dirname(one))
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
    lines = fragments.render(COMMON, values)
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
    "additional_parameters": "resources.sbatch_extra or notify.email",
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


def python_words(text) -> str:
    """The saved Python command, as plain words again (never shell syntax); this
    interpreter when the file has none (written before containers) or a damaged one."""
    try:
        words = shlex.split(text) if isinstance(text, str) else []
        for w in words:
            slurmtext.argv_element(w)
    except ValueError:
        words = []
    return shlex.join(words) if words else shlex.quote(sys.executable)
