"""Notifications (spec `notify`): ledger events become webhook POSTs, exactly one per
configured event, delivered from a background thread so that a slow or dead server
delays no watcher cycle, retried with backoff until it answers, never lost.

The webhook is a real HTTP server on 127.0.0.1 that records every request; time in the
ledger is an injected clock, so backoff is checked without waiting for it."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import cli, free_port, write
from orchestrator.errors import SpecError
from orchestrator.ledger import Ledger
from orchestrator.notify import outbox, triggers
from orchestrator.notify.outbox import Notifier
from orchestrator.spec.load import load_spec
from orchestrator.spec.sweep import expand
from orchestrator.states import TaskState
from orchestrator.supervise.watcher import Watcher, watch

ALL = ["failed", "recovered", "completed", "needs_attention"]


class Hook:
    """A webhook: records each POST (path, headers, JSON body, the status it answered)."""

    def __init__(self, port: int = 0):
        self.requests: list[dict] = []
        self.statuses: list[int] = []  # answered in turn; then 200
        self.sleep_s = 0.0
        self.location: str | None = None  # answer a redirect there
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = hook.statuses.pop(0) if hook.statuses else (302 if hook.location else 200)
                hook.requests.append({"path": self.path, "type": self.headers.get("Content-Type"), "body": json.loads(body),
                                      "status": status})
                time.sleep(hook.sleep_s)
                self.send_response(status)
                if status == 302:
                    self.send_header("Location", hook.location)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/T0/B0/secret"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def delivered(self) -> list[dict]:
        return [r["body"] for r in self.requests if r["status"] == 200]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


class Clock:
    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def experiment(ledger, exp_id, notify, n=1, run_dir="/runs/x"):
    ledger.create_experiment(
        {"id": exp_id, "name": f"demo-{exp_id}", "executor": "local", "spec_path": "/s.yaml", "run_dir": run_dir,
         "spec": json.dumps({"name": f"demo-{exp_id}", "notify": notify}, sort_keys=True)},
        [{"idx": i, "params": {}, "task_dir": f"{run_dir}/tasks/{i}"} for i in range(n)],
    )


def moves(ledger, exp_id, idx, *states):
    for s in states:
        assert ledger.set_task_state(exp_id, idx, TaskState(s), f"test: {s.lower()}")


def settle(notifier, timeout=10.0):
    """Wait for the sender thread's outcomes and record them (as the next cycle would)."""
    deadline = time.monotonic() + timeout
    while notifier.in_flight:
        assert time.monotonic() < deadline, "the sender never reported"
        time.sleep(0.01)
        notifier.record()


def kinds(ledger, exp_id, prefix="notify."):
    return [e for e in ledger.events(exp_id) if e["kind"].startswith(prefix)]


def timed_cycle(notifier, ids):
    start = time.monotonic()
    notifier.cycle(ids)
    return time.monotonic() - start


# ---------------------------------------------------------------- which events, exactly once


def test_one_message_per_configured_event_and_none_twice(tmp_path, hook):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "e1", {"webhook": hook.url, "on": ALL, "timeout_s": 5.0}, n=3)
    experiment(ledger, "e2", {"webhook": hook.url, "on": ["completed"], "timeout_s": 5.0})
    moves(ledger, "e1", 0, "RUNNING", "RECOVERING", "RUNNING", "FAILED")  # recovered, failed
    moves(ledger, "e1", 1, "RUNNING", "RECOVERING", "PENDING", "RUNNING")  # recovered: requeued, waited, ran again
    ledger.event("e1", "attempt.restarted", "rank 1 died: restarting in place", idx=2, attempt=1)  # recovered
    for kind in sorted(triggers.NEEDS_ATTENTION_KINDS):
        ledger.event("e1", kind, f"test: {kind}", idx=2)
    for kind in ("hang.detected", "scheduler.reachable", "queue.waiting", "record.skipped", "checkpoint.committed"):
        ledger.event("e1", kind, f"test: {kind}", idx=2)  # none of these is a trigger
    moves(ledger, "e1", 1, "COMPLETED")
    moves(ledger, "e1", 2, "RUNNING", "COMPLETED")  # the experiment ends FAILED: needs_attention
    moves(ledger, "e2", 0, "RUNNING", "RECOVERING", "RUNNING", "COMPLETED")  # e2 wants only `completed`

    notifier = Notifier(ledger, "test-watcher")
    assert timed_cycle(notifier, ["e1", "e2"]) < 2.0
    settle(notifier)
    for _ in range(3):
        notifier.cycle(["e1", "e2"])
        settle(notifier)

    bodies = hook.delivered()
    got = sorted(tuple(b["orchestrate"][k] for k in ("experiment", "trigger", "kind", "task")) for b in bodies)
    want = sorted(
        [("e1", "recovered", "task.state", 0), ("e1", "failed", "task.state", 0), ("e1", "recovered", "task.state", 1),
         ("e1", "recovered", "attempt.restarted", 2), ("e1", "needs_attention", "experiment.state", None),
         ("e2", "completed", "experiment.state", None)]
        + [("e1", "needs_attention", k, 2) for k in triggers.NEEDS_ATTENTION_KINDS]
    )
    assert got == want
    assert len({(b["orchestrate"]["event_id"], b["orchestrate"]["trigger"]) for b in bodies}) == len(bodies) == len(hook.requests)
    assert all(r["type"] == "application/json" and r["path"] == "/services/T0/B0/secret" for r in hook.requests)

    failed = next(b for b in bodies if b["orchestrate"]["trigger"] == "failed")
    event = next(e for e in ledger.events("e1") if e["id"] == failed["orchestrate"]["event_id"])
    assert failed["orchestrate"] == {"experiment": "e1", "name": "demo-e1", "task": 0, "trigger": "failed", "event_id": event["id"],
                                     "kind": "task.state", "cause": "test: failed", "time": event["time"]}
    assert failed["text"] == "orchestrate: demo-e1 (e1) task 0: task failed: test: failed" and "\n" not in failed["text"]

    sent = kinds(ledger, "e1") + kinds(ledger, "e2")
    assert [e["kind"] for e in sent] == ["notify.sent"] * len(bodies)
    assert all(hook.url not in e["cause"] and "secret" not in e["cause"] for e in sent)  # a webhook URL is a secret
    assert f"failed notification of event {event['id']} delivered (HTTP 200)" in [e["cause"] for e in sent]
    rows = ledger.notifications("e1") + ledger.notifications("e2")
    assert {r["state"] for r in rows} == {"SENT"} and len(rows) == len(bodies)

    # a new watcher (the cursor and the rows are in the ledger) sends nothing again
    ledger.close()
    again = Ledger.open(tmp_path / "ledger.db", clock=clock)
    fresh = Notifier(again, "another-watcher")
    fresh.cycle(["e1", "e2"], backlog=True)
    settle(fresh)
    assert len(hook.requests) == len(bodies)


def test_the_watcher_sends_them_and_its_exit_waits_for_what_is_under_way(tmp_path, hook):
    ledger = Ledger.open(tmp_path / "ledger.db")
    experiment(ledger, "w1", {"webhook": hook.url, "on": ["failed", "completed"], "timeout_s": 5.0}, n=2, run_dir=str(tmp_path / "run"))
    moves(ledger, "w1", 0, "RUNNING", "COMPLETED")
    moves(ledger, "w1", 1, "RUNNING", "FAILED")
    hook.sleep_s = 0.3  # answered only after the cycle returned: the exit's grace records it
    watch(ledger, ["w1"], interval_s=0.1, once=True)
    assert [b["orchestrate"]["trigger"] for b in hook.delivered()] == ["failed"]  # the experiment failed: not `completed`
    assert [e["kind"] for e in kinds(ledger, "w1")] == ["notify.sent"]
    # the real cycle with nothing new sends nothing
    w = Watcher(ledger, interval_s=0.1)
    w.cycle(["w1"])
    w.close()
    assert len(hook.requests) == 1


def test_pending_notifications_of_ended_experiments_go_out_with_the_next_watcher(tmp_path, hook):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "p1", {"webhook_env": "HOOK_URL", "on": ALL, "timeout_s": 5.0})
    moves(ledger, "p1", 0, "RUNNING", "COMPLETED")
    env = {}  # the first watcher lacks the variable: the row waits
    first = Notifier(ledger, "first", env=env)
    first.cycle(["p1"])
    first.close()
    (row,) = ledger.notifications("p1")
    assert row["state"] == "PENDING" and row["attempts"] == 1 and "$HOOK_URL is not set" in row["last_error"]
    assert [e["kind"] for e in kinds(ledger, "p1")] == ["notify.failed"]
    # `orchestrate watch` of everything: p1 is no longer live, its notification still goes out,
    # at once (a watcher that starts tries what is pending, backoff or not)
    second = Notifier(ledger, "second", env={"HOOK_URL": hook.url})
    second.cycle([], backlog=True)
    settle(second)
    assert [b["orchestrate"]["trigger"] for b in hook.delivered()] == ["completed"]
    assert ledger.notifications("p1")[0]["state"] == "SENT"
    second.cycle([], backlog=True)  # looks past its own notify.sent event: nothing is left for a watcher of everything
    assert ledger.notify_backlog(outbox.CURSOR) == [] and len(hook.requests) == 1


# ---------------------------------------------------------------- a server down delays nothing, loses nothing


def three_failures(ledger):
    for i in range(3):
        ledger.event("d1", "watcher.failed", f"test: failure {i}", idx=i)


def test_nothing_listening_then_the_server_comes_back(tmp_path):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    port = free_port()
    experiment(ledger, "d1", {"webhook": f"http://127.0.0.1:{port}/hook", "on": ALL, "timeout_s": 5.0}, n=3)
    three_failures(ledger)
    n = Notifier(ledger, "w")
    assert timed_cycle(n, ["d1"]) < 2.0
    settle(n)
    rows = ledger.notifications("d1")
    assert [r["attempts"] for r in rows] == [1, 1, 1] and all(r["state"] == "PENDING" for r in rows)
    assert all(r["next_at"] == clock.t + outbox.backoff_s(1) for r in rows)
    (failed,) = kinds(ledger, "d1")  # one event for the outage, not one per message or retry
    assert failed["kind"] == "notify.failed" and "cannot reach the webhook" in failed["cause"] and str(port) not in failed["cause"]

    server = Hook(port)
    try:
        clock.t += outbox.backoff_s(1) - 1  # not due yet
        n.cycle(["d1"])
        settle(n)
        assert server.requests == []
        clock.t += 1
        n.cycle(["d1"])
        settle(n)
        for _ in range(2):
            clock.t += 3600
            n.cycle(["d1"])
            settle(n)
        assert [b["orchestrate"]["cause"] for b in server.delivered()] == [f"test: failure {i}" for i in range(3)]  # oldest first
        assert [e["kind"] for e in kinds(ledger, "d1")] == ["notify.failed"] + ["notify.sent"] * 3
    finally:
        server.close()


def test_a_server_error_is_retried_with_backoff_and_reported_once(tmp_path, hook):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "d1", {"webhook": hook.url, "on": ALL, "timeout_s": 5.0}, n=3)
    three_failures(ledger)
    hook.statuses = [500, 503]
    n = Notifier(ledger, "w")
    n.cycle(["d1"])
    settle(n)
    assert len(hook.requests) == 1  # the rest of the batch is not tried against a failing server
    clock.t += outbox.backoff_s(1)
    n.cycle(["d1"])
    settle(n)
    assert [r["status"] for r in hook.requests] == [500, 503]
    assert [r["attempts"] for r in ledger.notifications("d1")] == [2, 2, 2]
    clock.t += outbox.backoff_s(2) - 1  # backoff doubled: not due yet
    n.cycle(["d1"])
    settle(n)
    assert len(hook.requests) == 2
    clock.t += 1
    n.cycle(["d1"])
    settle(n)
    assert sorted(b["orchestrate"]["cause"] for b in hook.delivered()) == [f"test: failure {i}" for i in range(3)]
    causes = [(e["kind"], e["cause"]) for e in kinds(ledger, "d1")]
    assert [k for k, _ in causes] == ["notify.failed", "notify.failed", "notify.sent", "notify.sent", "notify.sent"]  # 500, then 503
    assert "HTTP 500" in causes[0][1] and "HTTP 503" in causes[1][1]


def test_a_slow_server_delays_no_cycle(tmp_path, hook):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "d1", {"webhook": hook.url, "on": ALL, "timeout_s": 1.0}, n=3)
    three_failures(ledger)
    hook.sleep_s = 4.0
    n = Notifier(ledger, "w")
    start = time.monotonic()
    n.cycle(["d1"])
    assert time.monotonic() - start < 1.0  # returned before the POST's timeout could fire, let alone the server's answer
    assert n.in_flight and [r["attempts"] for r in ledger.notifications("d1")] == [0, 0, 0]  # under way in the thread
    settle(n)
    assert time.monotonic() - start < hook.sleep_s  # the timeout ended it, not the server
    rows = ledger.notifications("d1")
    assert [r["attempts"] for r in rows] == [1, 1, 1] and "timed out" in rows[0]["last_error"]
    hook.sleep_s = 0.0
    clock.t += outbox.backoff_s(1)
    n.cycle(["d1"])
    settle(n)
    assert [r["state"] for r in ledger.notifications("d1")] == ["SENT"] * 3
    assert [e["kind"] for e in kinds(ledger, "d1")].count("notify.sent") == 3


def test_a_real_watcher_cycle_does_not_wait_for_the_webhook(tmp_path, hook):
    ledger = Ledger.open(tmp_path / "ledger.db")
    experiment(ledger, "s1", {"webhook": hook.url, "on": ALL, "timeout_s": 10.0}, run_dir=str(tmp_path / "run"))
    moves(ledger, "s1", 0, "RUNNING", "FAILED")
    hook.sleep_s = 2.0
    w = Watcher(ledger, interval_s=0.1)
    start = time.monotonic()
    w.cycle(["s1"])
    assert time.monotonic() - start < 1.0 and w.notifier.in_flight
    w.notifier.close(grace_s=0.1)  # what the sender did not report in the grace stays PENDING, for the next watcher
    assert {r["state"] for r in ledger.notifications("s1")} == {"PENDING"}


def test_refusals_are_dropped_at_once_and_redirects_never_followed(tmp_path, hook):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "r1", {"webhook": hook.url, "on": ALL, "timeout_s": 5.0})
    other = Hook()
    try:
        hook.statuses = [404]
        ledger.event("r1", "watcher.failed", "test: refused", idx=0)
        n = Notifier(ledger, "w")
        n.cycle(["r1"])
        settle(n)
        hook.location = other.url
        ledger.event("r1", "watcher.failed", "test: redirected", idx=0)
        n.cycle(["r1"])
        settle(n)
        clock.t += 86400
        n.cycle(["r1"])
        settle(n)
        assert [r["status"] for r in hook.requests] == [404, 302] and other.requests == []
        assert [(r["state"], r["attempts"]) for r in ledger.notifications("r1")] == [("DROPPED", 1), ("DROPPED", 1)]
        dropped = kinds(ledger, "r1")
        assert [e["kind"] for e in dropped] == ["notify.dropped"] * 2
        assert "HTTP 404" in dropped[0]["cause"] and "redirects are not followed" in dropped[1]["cause"]
    finally:
        other.close()


def test_after_the_last_attempt_a_notification_is_dropped(tmp_path):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "m1", {"webhook": f"http://127.0.0.1:{free_port()}/", "on": ALL, "timeout_s": 5.0})
    ledger.event("m1", "scheduler.unreachable", "test: down")
    n = Notifier(ledger, "w", max_attempts=3)
    for _ in range(5):
        n.cycle(["m1"])
        settle(n)
        clock.t += outbox.BACKOFF_MAX_S
    (row,) = ledger.notifications("m1")
    assert (row["state"], row["attempts"]) == ("DROPPED", 3)
    assert [e["kind"] for e in kinds(ledger, "m1")] == ["notify.failed", "notify.dropped"]


def test_backoff_doubles_to_its_cap_and_twenty_attempts_span_about_a_day():
    waits = [outbox.backoff_s(a) for a in range(1, outbox.MAX_ATTEMPTS)]
    assert waits[:3] == [30, 60, 120] and max(waits) == outbox.BACKOFF_MAX_S
    assert 20 * 3600 < sum(waits) < 30 * 3600


def test_two_watchers_never_send_the_same_row(tmp_path, hook):
    ledger = Ledger.open(tmp_path / "ledger.db")
    experiment(ledger, "l1", {"webhook": hook.url, "on": ALL, "timeout_s": 5.0})
    ledger.event("l1", "watcher.failed", "test: once", idx=0)
    hook.sleep_s = 0.3
    a, b = Notifier(ledger, "a"), Notifier(ledger, "b")
    a.cycle(["l1"])
    b.cycle(["l1"])  # enqueues nothing new, and a holds the lease
    settle(a)
    assert not b.in_flight and len(hook.requests) == 1


# ---------------------------------------------------------------- the spec


def issues_of(tmp_path, notify_yaml):
    p = write(tmp_path / "n.yaml", "name: x\nsteps: 1\nnotify:\n" + notify_yaml)
    with pytest.raises(SpecError) as exc:
        spec, raw, lines = load_spec(p, [])
        expand(spec, raw, lines, str(p))
    return exc.value.issues


def test_the_spec_section_and_its_defaults(tmp_path):
    p = write(tmp_path / "n.yaml", "name: x\nsteps: 1\nnotify:\n  webhook_env: SLACK_WEBHOOK_URL\n  on: [failed, completed]\n")
    spec, _, _ = load_spec(p, [])  # `on:` is a key here, not YAML 1.1's true
    assert spec.notify.on == ["failed", "completed"] and spec.notify.webhook_env == "SLACK_WEBHOOK_URL" and spec.notify.timeout_s == 5.0
    spec, _, _ = load_spec(write(tmp_path / "m.yaml", "name: x\nsteps: 1\nnotify: {email: me@example.org}\n"), [])
    assert spec.notify.on == ALL and spec.notify.email == "me@example.org"
    spec, _, _ = load_spec(write(tmp_path / "o.yaml", "name: x\nsteps: 1\n"), [])
    assert spec.notify is None


@pytest.mark.parametrize(
    "notify_yaml, path, words",
    [
        ("  webhook: ftp://hooks.example.org/services/secret\n", "notify.webhook", "http:// or https://"),
        ("  webhook: 'https:///services/secret'\n", "notify.webhook", "has no host"),
        ("  webhook: https://hooks.example.org/services/secret\n  webhook_env: SLACK_WEBHOOK_URL\n", "notify.webhook_env", "not both"),
        ('  email: "me@example.org\\nmail-type: ALL"\n', "notify.email", "a newline"),
        ("  email: 'me@example.org,you@example.org'\n", "notify.email", "one plain e-mail address"),
        ("  webhook_env: 'SLACK URL'\n", "notify.webhook_env", "not an environment variable name"),
        ("  on: []\n  email: me@example.org\n", "notify.on", "at least 1"),
        ("  timeout_s: 600\n  email: me@example.org\n", "notify.timeout_s", "less than or equal to 60"),
        ("  on: [failed]\n", "notify.webhook", "nothing to notify"),
    ],
)
def test_bad_notify_names_the_field(tmp_path, notify_yaml, path, words):
    (issue,) = issues_of(tmp_path, notify_yaml)
    assert issue.path == path and words in issue.message, issue
    assert "secret" not in issue.message  # a webhook URL is never repeated


def test_notify_may_not_vary_in_a_sweep_nor_clash_with_sbatch_extra(tmp_path):
    (issue,) = issues_of(tmp_path, "  email: me@example.org\nsweep:\n  grid:\n    notify.email: [a@example.org, b@example.org]\n")
    assert "cannot vary across a sweep" in issue.message
    (issue,) = issues_of(tmp_path, "  email: me@example.org\nresources:\n  sbatch_extra: {mail-type: ALL}\n")
    assert issue.path == "notify.email" and "mail-type" in issue.message


@pytest.mark.parametrize(
    "notify_yaml, field",
    [
        ("  webhook: gopher://hooks.example.org/services/secret\n", "notify.webhook"),
        ("  webhook: https://hooks.example.org/services/secret\n  webhook_env: SLACK_WEBHOOK_URL\n", "notify.webhook_env"),
        ('  email: "me@example.org\\n#SBATCH --mail-type=ALL"\n', "notify.email"),
    ],
)
def test_cli_refuses_a_bad_notify_with_the_field_named(tmp_path, home, notify_yaml, field):
    p = write(tmp_path / "bad.yaml", "name: x\nsteps: 1\nnotify:\n" + notify_yaml)
    out = cli("validate", str(p), home=home)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"bad.yaml:4: {field}:" in out.stderr or f"bad.yaml:5: {field}:" in out.stderr, out.stderr
    assert "secret" not in out.stderr


# ---------------------------------------------------------------- triggers and the message (pure)


def test_a_task_that_starts_for_the_first_time_is_not_recovered():
    first = {"kind": "task.state", "old_state": "PENDING", "new_state": "RUNNING"}
    assert triggers.needs_previous(first)
    assert triggers.trigger_of(first, None) is None
    assert triggers.trigger_of(first, {"old_state": "PENDING", "new_state": "PENDING"}) is None
    assert triggers.trigger_of(first, {"old_state": "RECOVERING", "new_state": "PENDING"}) == "recovered"
    assert triggers.trigger_of({"kind": "experiment.state", "new_state": "CANCELLED"}) is None
    assert triggers.trigger_of({"kind": "task.state", "old_state": "RUNNING", "new_state": "CANCELLED"}) is None


def test_the_message_is_one_escaped_line():
    msg = triggers.message({"id": "e1", "name": "demo"}, {"id": 7, "idx": 3, "kind": "watcher.failed", "time": 1.0,
                                                         "cause": "boom <!channel>\nline two & more"}, "needs_attention")
    assert msg["text"] == "orchestrate: demo (e1) task 3: needs attention: boom &lt;!channel&gt; line two &amp; more"
    assert msg["orchestrate"]["cause"] == "boom <!channel> line two & more"
