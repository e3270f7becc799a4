"""Tasks waiting for space: an attempt that ended on a full or failing filesystem is not
retried blindly. Its recovery is written down as a wait (``wait_storage``, one event, one
``needs_attention`` notification), with what the next checkpoint needs; each cycle the
watcher looks at the task's checkpoint folder (free space, then a probe write) and, once
the space is back, turns the wait into the recovery it stands for and carries it out.

Only folders the watcher knows itself are looked at or written to (the task's, from the
ledger): a path in a rank's error record is shown, never followed.
"""

from __future__ import annotations

import secrets

from orchestrator import contract
from orchestrator.contract import storage
from orchestrator.contract.safe_read import cut
from orchestrator.runfolder.launches import read_launch
from orchestrator.states import ActionState
from orchestrator.supervise.acting import Acting
from orchestrator.supervise.recovery import RecoveryKind, space_back


def storage_record(task_dir: str, launch_key: str | None) -> dict:
    """The storage fields of the launch's error records (the root cause's first), if any."""
    launch = read_launch(contract.launch_dir(task_dir, launch_key), []) if launch_key else None  # that one alone
    errors = sorted(launch.errors if launch else [], key=lambda e: e.get("time", 0))
    found = [e for e in errors if e.get("storage_errno")]
    if not found:
        return {}
    need = max((e.get("need_bytes") or 0 for e in found), default=0)
    return {**found[0], "need_bytes": need or None}


def need_bytes(task_dir: str, recorded: int | None, keep_last: int = 1) -> tuple[int, int]:
    """What the task needs free to go on, and its checkpoints' size: room for ``keep_last``
    checkpoints kept and one being written (the newest one's size, or what the refused save
    asked for, the larger), less those already there, and some for its logs and records."""
    committed = contract.committed_checkpoints(task_dir)
    size = max(storage.tree_bytes(committed[0][1]) if committed else 0, recorded or 0)
    return max(1, keep_last + 1 - len(committed)) * size + storage.MARGIN_BYTES, size


def disk_full(task_dir: str) -> bool:
    """The task's checkpoint folder has no room for its next checkpoint (an attempt that
    ended with no word of why may have died of it: a driver, an agent that could not write)."""
    free = storage.free_bytes(contract.checkpoints_dir(task_dir))
    return free is not None and free < need_bytes(task_dir, None)[0]


def plan_wait(act: Acting, exp: dict, task: dict, attempt: dict, then: RecoveryKind, cause: str, keep_last: int) -> None:
    """Write the wait down (its event says where, what is needed and what is free) in place
    of the recovery ``then``; the task's reason says it too, for `status`. ``cause``: why,
    where no rank's record tells it."""
    rec = storage_record(task["task_dir"], attempt.get("launch"))
    folder = str(contract.checkpoints_dir(task["task_dir"]))
    need, size = need_bytes(task["task_dir"], rec.get("need_bytes"), keep_last)
    what = storage.words(rec.get("storage_errno")) if rec else cause
    if rec.get("storage_path"):
        what += f" writing {cut(rec['storage_path'], 300)}"
    words = (f"needs space on {folder}: {what}; the run needs about {storage.size_words(need)} free to go on (room for "
             f"{keep_last} kept checkpoint(s) of about {storage.size_words(size)} and one being written), "
             f"{storage.size_words(storage.free_bytes(folder))} free. Waiting: it resumes by itself once space is back")
    detail = {"then": then.value, "folder": folder, "need_bytes": need, "job_id": attempt["job_id"], "exclude": [],
              "delay_s": 0, "tag": f"r{secrets.token_hex(3)}"}
    if act.ledger.plan_action(exp["id"], task["idx"], attempt["number"], RecoveryKind.WAIT_STORAGE.value, detail, words):
        act.ledger.update_task(exp["id"], task["idx"], reason=cut(words, 500))  # cleared when it resumes


def waiting(act: Acting, exp: dict, task: dict, attempt: dict) -> dict | None:
    """The attempt's wait for space, if it has one still planned."""
    for a in act.ledger.actions(exp["id"], task["idx"], state=ActionState.PLANNED):
        if a["attempt"] == attempt["number"] and a["kind"] == RecoveryKind.WAIT_STORAGE:
            return a
    return None


def space_ready(act: Acting, exp: dict, task: dict, attempt: dict) -> tuple[RecoveryKind, dict, str] | None:
    """For a task waiting for space: once its folder has room for the next checkpoint and a
    probe write goes through, the recovery the wait stood for, its detail and its cause."""
    action = waiting(act, exp, task, attempt)
    if action is None:
        return None
    detail = action["detail"]
    folder = str(contract.checkpoints_dir(task["task_dir"]))  # the ledger's folder, never the record's
    verdict = space_back(storage.free_bytes(folder), int(detail.get("need_bytes") or storage.MARGIN_BYTES),
                         lambda: storage.probe(folder))
    if verdict is None:
        return None
    then = RecoveryKind(detail.get("then") or RecoveryKind.RESUBMIT)
    cause = f"space is back on {folder}: {verdict}; resumed from the last committed checkpoint"
    return then, {**detail, "tag": f"r{secrets.token_hex(3)}"}, cause
