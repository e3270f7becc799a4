"""Hung ranks: a launch whose ranks went silent gets an end record the node agents act
on (dump every rank's stacks, then restart in place or stop); agents that do not answer
it have the attempt recovered through SLURM."""

from __future__ import annotations

from pathlib import Path

from orchestrator import contract
from orchestrator.contract import FailureKind, GenerationAction, TaskConfig, records
from orchestrator.contract.safe_read import cut
from orchestrator.ledger.values import stored_number
from orchestrator.states import AttemptState, TaskState
from orchestrator.runfolder import badrecords
from orchestrator.supervise import faults, recovery
from orchestrator.supervise.acting import Acting
from orchestrator.runfolder.launches import read_generation_ends, read_launch
from orchestrator.supervise.refresh import PollPacer


def check(act: Acting, exp: dict, task: dict, attempt: dict, cfg: TaskConfig, pacer: PollPacer) -> None:
    """The running attempt's heartbeats against its timeouts; a hang found is written
    down as the generation's end record (once: whoever creates the file first)."""
    if attempt["state"] != AttemptState.RUNNING.value or not attempt["launch"]:
        return
    beats = act.ledger.heartbeats(exp["id"], task["idx"])
    note_timeout(act, exp, task, cfg)
    hang = recovery.find_hang(beats, attempt["launch"], cfg.heartbeat, task.get("step_time_max"), act.clock(),
                              task.get("step_time_steady"), task.get("save_time_max"))
    if hang is None:
        return
    ldir = contract.launch_dir(task["task_dir"], attempt["launch"])
    if contract.generation_end_path(ldir, hang.generation).exists():
        escalate_unanswered(act, exp, task, attempt, ldir, hang.generation)  # the agents are on it, unless they are hung too
        return
    history = read_generation_ends(ldir)[: hang.generation]
    record = contract.generation_end(
        FailureKind.HANG,
        hang.cause,
        hang.generation,
        history,
        cfg.retry.max_restarts,
        hang.step,
        dump=True,
        rank=hang.rank,
        node=hang.node,
        by=f"watcher {act.owner}",
    )
    pacer.hurry()  # silent ranks: what SLURM says of their job matters now (a node failure?)
    if contract.create_exclusive_json(contract.generation_end_path(ldir, hang.generation), record):
        what = "the agents dump every rank's stacks, then restart in place" if record["action"] == GenerationAction.RESTART else "the agents dump every rank's stacks, then stop the launch"
        act.ledger.event(exp["id"], "hang.detected", f"{hang.cause}: {record['decision']}; {what}", idx=task["idx"], attempt=attempt["number"])


def note_timeout(act: Acting, exp: dict, task: dict, cfg: TaskConfig) -> None:
    """The steady training's hang timeout in effect, kept on the task (status shows it) and,
    once learned and whenever it moves by more than a tenth, an event that says why."""
    steady, slowest = (max(stored_number(task.get(k)), 0.0) for k in ("step_time_steady", "step_time_max"))
    timeout = recovery.steady_timeout(cfg.heartbeat, slowest, steady)
    before = max(stored_number(task.get("hang_timeout_s")), 0.0)
    if before and abs(timeout - before) <= 0.1 * before:
        return
    if cfg.heartbeat.timeout_s:
        why = "heartbeat.timeout_s"
    elif steady and timeout < recovery.train_timeout(cfg.heartbeat, slowest):
        why = (f"learned: {recovery.STEADY_TIMEOUT_FACTOR:g} x the slowest steady step, {steady:.2f} s "
               f"(at least {recovery.STEADY_TIMEOUT_MIN_S:g} s)")
    else:
        why = (f"learned: {recovery.LEARNED_TIMEOUT_FACTOR:g} x the slowest step, {slowest:.2f} s (at least "
               f"{recovery.LEARNED_TIMEOUT_MIN_S:g} s), until the ranks report steady steps")
    with act.ledger.tx():
        act.ledger.update_task(exp["id"], task["idx"], hang_timeout_s=timeout)
        act.ledger.event(exp["id"], "hang.timeout", f"a training rank silent for {timeout:.0f} s "
                         f"(+ {cfg.heartbeat.interval_s:g} s between heartbeats) is hung; {why}", idx=task["idx"])
    task["hang_timeout_s"] = timeout


def escalate_unanswered(act: Acting, exp: dict, task: dict, attempt: dict, ldir: Path, generation: int) -> None:
    """Agents that do not answer an end record (stopped, or hung with their ranks) can
    restart nothing: the attempt failed with a hang, and the recovery goes through SLURM
    (``scontrol requeue`` of the running job, which kills whatever is left of it)."""
    if not act.scheduler(exp["executor"]).capabilities.requeue_in_place:
        return  # a new submission would run beside the stuck processes in the same task folder
    problems: list = []
    record = badrecords.read(contract.generation_end_path(ldir, generation), records.GENERATION_END, problems)
    launch = read_launch(ldir, problems)
    if record is None or launch is None or launch.node_records:
        return  # unreadable (refresh reports it), or an agent is ending the launch itself
    nodes = max(1, len(launch.nodes))
    stopped = sum(contract.generation_stopped_path(ldir, generation, n).exists() for n in range(nodes))
    age = recovery.unanswered_for(record["time"], stopped, nodes, act.clock(), faults.agent_answer_s())
    if age is None:
        return
    cause = (f"{record['cause']}; the node agents did not answer within {age:.0f} s "
             f"({nodes - stopped} of {nodes} node(s) silent): the attempt is recovered through SLURM")
    with act.ledger.tx():
        if act.ledger.update_attempt(exp["id"], task["idx"], attempt["number"], cause, state=AttemptState.FAILED.value,
                                     failure=FailureKind.HANG.value, reason=cut(cause, 500), ended_at=act.clock()):
            act.ledger.set_task_state(exp["id"], task["idx"], TaskState.RECOVERING, cause)
            act.ledger.event(exp["id"], "hang.escalated", cause, idx=task["idx"], attempt=attempt["number"])
