"""Tasks the queue had no room for at submit (MaxSubmitJobs, MaxJobCount): the watcher
submits them as room frees up, writes each submission down before sbatch and records it
after, and a watcher killed in between neither loses nor doubles a task. The scheduler
here is a stand-in that counts jobs; the real thing runs in test_site_limits_slurm."""

import json

from orchestrator.ledger import Ledger
from orchestrator.scheduler.base import Capabilities, Observation
from orchestrator.scheduler.site_limits import QUEUE_WAITING, Room
from orchestrator.states import AttemptState, TaskState
from orchestrator.supervise import cancel
from orchestrator.supervise.leases import ALL_LEASE, watching_all
from orchestrator.supervise.watcher import Watcher


class Queue:
    """A queue with MaxSubmitJobs ``limit``: every job it holds is pending until ``end`` is called."""

    name = "slurm"
    capabilities = Capabilities(requeue_in_place=True, requeues_by_itself=True, tells_why_stopped=True, costly_poll=True)

    def __init__(self, limit):
        self.limit, self.jobs, self.ended, self.submissions, self.cancelled = limit, {}, set(), [], []
        self.next_array = 100

    def queued(self):
        return [j for j in self.jobs if j not in self.ended]

    def queue_room(self, run_dir, wanted):
        return Room(self.limit - len(self.queued()), f"MaxSubmitJobs {self.limit}", self.limit, 10)

    def submit_tasks(self, run_dir, indices, max_parallel, after, tag):
        assert len(indices) <= self.limit - len(self.queued()), "over the limit: SLURM would refuse"
        self.next_array += 1
        jobs = {i: f"{self.next_array}_{k}" for k, i in enumerate(indices)}
        self.jobs.update({j: tag for j in jobs.values()})
        self.submissions.append((list(indices), max_parallel, after, tag))
        return jobs

    def find_tasks(self, run_dir, tag, since, indices):
        found = sorted({j.split("_")[0] for j, t in self.jobs.items() if t == tag})
        return {i: f"{found[0]}_{k}" for k, i in enumerate(indices)} if found else {}

    def poll(self, refs):
        return {r.job_id: Observation(r.job_id, AttemptState.COMPLETED if r.job_id in self.ended else AttemptState.PENDING,
                                      0 if r.job_id in self.ended else None) for r in refs if r.job_id in self.jobs}

    def cancel(self, refs):
        self.cancelled += [r.job_id for r in refs]

    def node_states(self):
        return {}


def experiment(ledger, tmp_path, n, queue, submitted, max_parallel=None, marked=True):
    spec = {"sweep": {"max_parallel": max_parallel}}
    ledger.create_experiment(
        {"id": "e1", "name": "limits", "executor": "slurm", "spec_path": "x.yaml", "run_dir": str(tmp_path), "spec": json.dumps(spec)},
        [{"idx": i, "params": {}, "task_dir": str(tmp_path / f"task-{i}")} for i in range(n)],
    )
    for idx, job in queue.submit_tasks(tmp_path, list(range(submitted)), max_parallel, None, "first").items():
        ledger.add_attempt("e1", idx, job, "submitted")
    if marked:  # as submission.submit says it, in the transaction of the first attempts
        ledger.event("e1", QUEUE_WAITING, f"{n - submitted} task(s) wait")


def test_waiting_tasks_go_out_as_room_frees_and_never_over_the_limit(tmp_path):
    ledger, queue = Ledger.memory(strict=True), Queue(limit=4)
    experiment(ledger, tmp_path, 7, queue, submitted=4)
    w = Watcher(ledger, interval_s=0.0, schedulers={"slurm": queue})
    w.cycle(["e1"])
    assert len(queue.submissions) == 1  # no room yet
    queue.ended |= {"101_0", "101_1"}
    w.cycle(["e1"])
    assert queue.submissions[-1][0] == [4, 5] and [a["job_id"] for a in ledger.attempts("e1")][4:] == ["102_0", "102_1"]
    queue.ended |= {"101_2", "101_3"}
    w.cycle(["e1"])
    assert queue.submissions[-1][0] == [6] and all(ledger.attempts("e1", i) for i in range(7))
    kinds = [e["kind"] for e in ledger.events("e1")]
    assert kinds.count("queue.submit") == 3 and kinds.count("queue.submit.done") == 3
    done = [e["cause"] for e in ledger.events("e1") if e["kind"] == "queue.submit"]
    assert "2 of 3 waiting task(s) go out as one array (room for 2 more job(s) (MaxSubmitJobs 4))" in done[0], done


def test_tasks_without_a_job_are_left_alone_while_their_submission_is_still_recording_them(tmp_path):
    ledger, queue = Ledger.memory(strict=True), Queue(limit=10)
    experiment(ledger, tmp_path, 5, queue, submitted=2, marked=False)  # `submit` is between sbatch and its ledger rows
    Watcher(ledger, interval_s=0.0, schedulers={"slurm": queue}).cycle(["e1"])
    assert len(queue.submissions) == 1 and not ledger.attempts("e1", 4)


def test_with_max_parallel_each_array_waits_for_a_full_budget_and_chains_after_the_last(tmp_path):
    ledger, queue = Ledger.memory(strict=True), Queue(limit=4)
    experiment(ledger, tmp_path, 9, queue, submitted=4, max_parallel=3)
    w = Watcher(ledger, interval_s=0.0, schedulers={"slurm": queue})
    queue.ended |= {"101_0", "101_1"}
    w.cycle(["e1"])
    assert len(queue.submissions) == 1  # room for 2 < a budget of 3 while the experiment still has jobs queued
    queue.ended.add("101_2")
    w.cycle(["e1"])
    assert queue.submissions[-1] == ([4, 5, 6], 3, "101", queue.submissions[-1][3])  # after the array before it
    queue.ended |= {"101_3", "102_0", "102_1", "102_2"}
    w.cycle(["e1"])
    assert queue.submissions[-1][0] == [7, 8] and queue.submissions[-1][2] is None  # everything before it ended


def test_a_submission_a_killed_watcher_made_is_found_and_one_it_never_made_is_made_again(tmp_path):
    ledger, queue = Ledger.memory(strict=True), Queue(limit=4)
    experiment(ledger, tmp_path, 6, queue, submitted=2)
    # a watcher wrote tasks 2 and 3 down and queued them, then died before recording the jobs
    for k, idx in enumerate((2, 3)):
        ledger.plan_action("e1", idx, 0, "submit", {"tag": "qdead", "position": k, "after": None}, "planned", topic="queue")
    queue.submit_tasks(tmp_path, [2, 3], None, None, "qdead")
    # and another wrote tasks 4 and 5 down and died before sbatch
    for k, idx in enumerate((4, 5)):
        ledger.plan_action("e1", idx, 0, "submit", {"tag": "qlost", "position": k, "after": None}, "planned", topic="queue")
    w = Watcher(ledger, interval_s=0.0, schedulers={"slurm": queue})
    w.cycle(["e1"])
    assert [ledger.attempts("e1", i)[0]["job_id"] for i in (2, 3)] == ["102_0", "102_1"] and len(queue.submissions) == 2
    assert not ledger.attempts("e1", 4) and [e["kind"] for e in ledger.events("e1")].count("queue.submit.dropped") == 2
    w.cycle(["e1"])  # no room: 4 queued
    queue.ended |= {"101_0", "101_1"}
    w.cycle(["e1"])
    assert queue.submissions[-1][0] == [4, 5] and all(len(ledger.attempts("e1", i)) == 1 for i in range(6))


def test_cancel_ends_waiting_tasks_at_once_and_a_job_submitted_meanwhile_is_cancelled(tmp_path):
    ledger, queue = Ledger.memory(strict=True), Queue(limit=3)
    experiment(ledger, tmp_path, 4, queue, submitted=2)
    assert sorted(cancel.cancel(ledger, ledger.experiment("e1"), 3)) == [3]
    assert ledger.task("e1", 3)["state"] == TaskState.CANCELLED.value
    # task 2 is cancelled while a watcher submits it: the job is recorded, then cancelled
    ledger.plan_action("e1", 2, 0, "submit", {"tag": "qrace", "position": 0, "after": None}, "planned", topic="queue")
    queue.submit_tasks(tmp_path, [2], None, None, "qrace")
    ledger.set_task_state("e1", 2, TaskState.CANCELLED, "orchestrate cancel")
    Watcher(ledger, interval_s=0.0, schedulers={"slurm": queue}).cycle(["e1"])
    assert queue.cancelled == ["102_0"] and ledger.attempts("e1", 2)[0]["job_id"] == "102_0"


def test_cancel_between_a_requeue_and_the_job_running_again_cancels_the_job_and_ends_the_task(tmp_path):
    # the CI failure: `orchestrate cancel` found the newest attempt REQUEUED (ended), cancelled
    # nothing, and the time-limited job ran again for ever
    ledger, queue = Ledger.memory(strict=True), Queue(limit=3)
    experiment(ledger, tmp_path, 2, queue, submitted=2)
    ledger.update_attempt("e1", 0, 1, "saved on the time limit signal", state=AttemptState.REQUEUED.value)
    ledger.set_task_state("e1", 0, TaskState.RECOVERING, "requeued")
    assert cancel.cancel(ledger, ledger.experiment("e1"), scheduler=queue) == [0, 1]
    assert sorted(queue.cancelled) == ["101_0", "101_1"]
    assert ledger.task("e1", 0)["state"] == TaskState.CANCELLED.value  # nothing runs to record its end
    assert ledger.task("e1", 1)["state"] != TaskState.CANCELLED.value  # its running launch records it
    assert "requeue" in [e for e in ledger.events("e1") if e["idx"] == 0][-1]["cause"]


def test_submit_knows_a_watcher_of_every_experiment_from_its_lease():
    ledger = Ledger.memory()
    assert not watching_all(ledger)
    ledger.acquire_lease(ALL_LEASE, "host:1", 30)
    assert watching_all(ledger)
