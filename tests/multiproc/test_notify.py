"""Notifications (spec `notify`): ledger events become webhook POSTs, exactly one per
configured event, delivered from a background thread so that a slow or dead server
delays no watcher cycle, retried with backoff until it answers, never lost.

The webhook is a real HTTP server on 127.0.0.1 that records every request; time in the
ledger is an injected clock, so backoff is checked without waiting for it."""

from __future__ import annotations

import json
import threading
import time

import pytest

from conftest import Hook, cli, free_port, write
from orchestrator.errors import SpecError
from orchestrator.ledger import Ledger
from orchestrator.notify import outbox, triggers
from orchestrator.notify.outbox import Notifier
from orchestrator.spec.load import load_spec
from orchestrator.spec.sweep import expand
from orchestrator.states import TaskState
from orchestrator.supervise.loop import watch
from orchestrator.supervise.watcher import Watcher

ALL = ["failed", "recovered", "completed", "needs_attention"]


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
    for kind in ("hang.detected", "scheduler.reachable", "queue.waiting", "record.skipped", "checkpoint.committed",
                 "ledger.illegal_transition"):  # an internal bug signal that may repeat each cycle: no flood
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
    assert leaks(ledger, "e1", "secret", hook.url.split("/")[2]) == leaks(ledger, "e2", "secret") == []  # a webhook URL is a secret
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
    for _ in range(3):
        first.cycle(["p1"])
        assert ledger.lease(outbox.LEASE + "p1") is None  # a watcher that cannot send takes no lease
        clock.t += outbox.BACKOFF_MAX_S
    first.close()
    (row,) = ledger.notifications("p1")
    assert row["state"] == "PENDING" and row["attempts"] == 0 and "$HOOK_URL is not set" in row["last_error"]  # no attempt counted
    assert [e["kind"] for e in kinds(ledger, "p1")] == ["notify.failed"]  # once per distinct problem
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


# ---------------------------------------------------------------- review fixes: a URL is a secret everywhere


SECRET_PARTS = ("TOPSECRET", "T0/B0")


def leaks(ledger, exp_id, *parts):
    """Every notify event's cause and every row's last error that shows one of ``parts``."""
    texts = [e["cause"] for e in kinds(ledger, exp_id)] + [r["last_error"] or "" for r in ledger.notifications(exp_id)]
    return [t for t in texts if any(p in t for p in parts)]


@pytest.mark.parametrize("url, words", [
    ("https://u:TOPSECRET@hooks.example.org/services/x", "user name or password"),
    ("https://TOPSECRET@hooks.example.org/services/x", "user name or password"),
    ("https://hooks.example.org/services/TOPSECRET\u00e9", "not ASCII"),
    ("https://h\u00f6oks.example.org/services/TOPSECRET", "not ASCII"),
])
def test_a_url_with_a_user_or_not_ascii_is_refused_without_repeating_it(tmp_path, url, words):
    from orchestrator.spec.notifications import url_problem

    problem = url_problem(url)
    assert problem and words in problem and "TOPSECRET" not in problem
    (issue,) = issues_of(tmp_path, f"  webhook: '{url}'\n")
    assert issue.path == "notify.webhook" and words in issue.message and "TOPSECRET" not in issue.message
    # in the variable `webhook_env` names: found when sending, recorded without the URL, nothing posted
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "u1", {"webhook_env": "HOOK_URL", "on": ALL, "timeout_s": 5.0})
    ledger.event("u1", "watcher.failed", "test: boom", idx=0)
    n = Notifier(ledger, "w", env={"HOOK_URL": url})
    n.cycle(["u1"])
    assert not n.in_flight and ledger.lease(outbox.LEASE + "u1") is None
    (row,) = ledger.notifications("u1")
    assert row["attempts"] == 0 and words in row["last_error"] and "$HOOK_URL" in row["last_error"]
    assert leaks(ledger, "u1", "TOPSECRET") == [] and [e["kind"] for e in kinds(ledger, "u1")] == ["notify.failed"]


def test_post_never_quotes_a_url_http_client_refuses():
    from orchestrator.notify import webhook

    for url in ("http://u:TOPSECRET@localhost/services/x", "http://127.0.0.1:1/services/TOPSECRET\u00e9"):
        outcome = webhook.post(webhook.Job(1, url, b"{}", 2.0))  # past the checks (a bug, or a future urllib)
        assert outcome.error and "TOPSECRET" not in outcome.error, outcome
    url = "http://user:TOPSECRET@127.0.0.1:9/services/T0/B0/x?token=TOPSECRETQ"
    text = webhook._scrub(f"at {url}: user:TOPSECRET@127.0.0.1:9 said no to /services/T0/B0/x and token=TOPSECRETQ", url)
    assert "TOPSECRET" not in text and "T0/B0" not in text and "<webhook>" in text


def test_no_event_nor_row_error_shows_the_url_whatever_the_server_answers(tmp_path, hook):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    url = hook.url.replace("secret", "TOPSECRET") + "?token=TOPSECRETQ"
    host = url.split("/")[2]
    experiment(ledger, "k1", {"webhook": url, "on": ALL, "timeout_s": 5.0})
    hook.reason = "no such hook {path} at {host}"  # a server that quotes the request back
    hook.statuses = [500, 404]
    ledger.event("k1", "watcher.failed", "test: one", idx=0)
    n = Notifier(ledger, "w")
    n.cycle(["k1"])
    settle(n)
    clock.t += outbox.backoff_s(1)
    n.cycle(["k1"])
    settle(n)
    assert [e["kind"] for e in kinds(ledger, "k1")] == ["notify.failed", "notify.dropped"]
    assert "HTTP 500" in kinds(ledger, "k1")[0]["cause"] and "HTTP 404" in ledger.notifications("k1")[0]["last_error"]
    assert leaks(ledger, "k1", *SECRET_PARTS, host, "TOPSECRETQ") == []


def test_set_items_of_the_webhook_are_never_shown_and_errors_name_their_own_item(tmp_path):
    p = write(tmp_path / "n.yaml", "name: x\nsteps: 1\n")

    def issues(*sets):
        with pytest.raises(SpecError) as exc:
            load_spec(p, list(sets))
        return exc.value.issues

    (issue,) = issues("notify.webhook=ftp://hooks.example.org/TOPSECRETKEY")
    assert issue.source == "--set" and "'notify.webhook=<hidden>'" in issue.message and "TOPSECRET" not in issue.message
    (issue,) = issues("notify={webhook: 'ftp://hooks.example.org/TOPSECRETKEY'}")
    assert "TOPSECRET" not in issue.message
    (issue,) = issues("notify.webhook=https://hooks.example.org/TOPSECRETKEY", "notify.timeout_s=600")
    assert issue.path == "notify.timeout_s" and "'notify.timeout_s=600'" in issue.message and "TOPSECRET" not in issue.message
    (issue,) = issues("notify.webhook=https://hooks.example.org/TOPSECRETKEY", "notify.webhook.x=1")  # an item's own error
    assert "TOPSECRET" not in issue.message
    (issue,) = issues("notify.webhook:https://hooks.example.org/TOPSECRETKEY")  # not key=value: the item is the URL
    assert "TOPSECRET" not in issue.message + issue.path
    (issue,) = issues("notify.webhook_env=https://hooks.example.org/TOPSECRETKEY")
    assert issue.path == "notify.webhook_env" and "is a URL" in issue.message and "TOPSECRET" not in issue.message


def test_a_url_given_as_webhook_env_is_not_repeated(tmp_path, home):
    (issue,) = issues_of(tmp_path, "  webhook_env: 'https://hooks.example.org/services/TOPSECRET'\n")
    assert issue.path == "notify.webhook_env" and "is a URL" in issue.message and "TOPSECRET" not in issue.message
    p = write(tmp_path / "bad.yaml", "name: x\nsteps: 1\nnotify:\n  webhook_env: https://hooks.example.org/services/TOPSECRET\n")
    out = cli("validate", str(p), "--set", "notify.webhook=ftp://x/TOPSECRETKEY", home=home)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "TOPSECRET" not in out.stderr + out.stdout, out.stderr


# ---------------------------------------------------------------- review fixes: who sends, and when


def test_a_watcher_sends_only_for_what_it_watches_and_gives_the_lease_back(tmp_path, hook):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "v1", {"webhook": hook.url, "on": ALL, "timeout_s": 5.0})
    ledger.event("v1", "watcher.failed", "test: one", idx=0)
    assert ledger.acquire_lease("watch:v1", "other-watcher", 30.0)
    mine = Notifier(ledger, "mine")
    mine.cycle(["v1"], backlog=True)
    settle(mine)
    assert hook.requests == [] and ledger.notifications("v1") == [] and ledger.lease(outbox.LEASE + "v1") is None
    ledger.release_lease("watch:v1", "other-watcher")  # the experiment ended: nobody watches it
    mine.cycle(["v1"])
    settle(mine)
    assert len(hook.delivered()) == 1
    assert ledger.lease(outbox.LEASE + "v1") is None  # its outcome recorded: the lease is given back
    assert ledger.acquire_lease("watch:v1", "mine", 30.0)  # and the one it watches itself
    ledger.event("v1", "watcher.failed", "test: two", idx=0)
    mine.cycle(["v1"])
    settle(mine)
    assert len(hook.delivered()) == 2


class Gate:
    """A sender's send that waits until opened, then answers 200 (or runs ``then``)."""

    def __init__(self):
        self.open = threading.Event()
        self.sent: list[int] = []

    def __call__(self, job):
        from orchestrator.notify.webhook import Outcome

        assert self.open.wait(30)
        self.sent.append(job.row_id)
        return Outcome(job.row_id, status=200)


def test_the_notify_lease_lasts_while_a_batch_is_under_way(tmp_path):
    from orchestrator.notify.webhook import Sender

    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "t1", {"webhook": "http://127.0.0.1:9/hook", "on": ALL, "timeout_s": 5.0})
    ledger.event("t1", "watcher.failed", "test: one", idx=0)
    gate = Gate()
    a = Notifier(ledger, "a", sender=Sender(gate))
    a.cycle(["t1"])
    assert a.in_flight
    for _ in range(5):  # far past the lease's first time to live: each cycle renews it
        clock.t += outbox.LEASE_S
        a.cycle(["t1"])
        assert ledger.lease(outbox.LEASE + "t1")["owner"] == "a"
    b = Notifier(ledger, "b", sender=Sender(Gate()))
    b.cycle(["t1"])
    assert not b.in_flight
    gate.open.set()
    settle(a)
    assert gate.sent == [ledger.notifications("t1")[0]["id"]] and ledger.lease(outbox.LEASE + "t1") is None


def test_a_post_has_a_wall_clock_deadline_against_a_server_that_drips(tmp_path):
    import socket as socketlib

    from orchestrator.notify import webhook

    server = socketlib.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    stop = threading.Event()

    def drip():
        conn, _ = server.accept()
        with conn:
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nX-Padding: " + b"x" * 200:  # a byte each 0.1 s: no socket read times out
                if stop.is_set():
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.1)

    threading.Thread(target=drip, daemon=True).start()
    try:
        start = time.monotonic()
        outcome = webhook.post(webhook.Job(1, f"http://127.0.0.1:{server.getsockname()[1]}/hook", b"{}", 1.0))
        took = time.monotonic() - start
    finally:
        stop.set()
        server.close()
    assert outcome.error and "timed out" in outcome.error and not outcome.permanent
    assert took < 10.0  # the drip lasts 20 s; the deadline is 1 s (loose: a loaded machine)


def test_a_new_watcher_keeps_the_backoff_of_what_failed(tmp_path):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "b1", {"webhook": f"http://127.0.0.1:{free_port()}/hook", "on": ALL, "timeout_s": 5.0})
    ledger.event("b1", "watcher.failed", "test: one", idx=0)
    first = Notifier(ledger, "w0")
    first.cycle(["b1"])
    settle(first)
    first.close()
    assert [r["attempts"] for r in ledger.notifications("b1")] == [1]
    for i in range(25):  # `watch --once` again and again, within the backoff: nothing is tried, nothing dropped
        n = Notifier(ledger, f"w{i + 1}")
        n.cycle(["b1"])
        settle(n)
        n.close(grace_s=0.5)
    (row,) = ledger.notifications("b1")
    assert (row["state"], row["attempts"]) == ("PENDING", 1)


def test_a_new_watcher_tries_at_once_what_waited_for_a_url(tmp_path, hook):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "b2", {"webhook_env": "HOOK_URL", "on": ALL, "timeout_s": 5.0}, n=2)
    ledger.event("b2", "watcher.failed", "test: one", idx=0)
    n = Notifier(ledger, "w1", env={})
    n.cycle(["b2"])
    (row,) = ledger.notifications("b2")
    assert row["attempts"] == 0 and "is not set" in row["last_error"]
    # as the first version left such a row: attempts counted, in backoff
    ledger.update_notification(row["id"], attempts=3, next_at=clock.t + 3600)
    ledger.event("b2", "watcher.failed", "test: two", idx=1)
    n = Notifier(ledger, "w2", env={"HOOK_URL": hook.url})  # the variable set: both tried at once, backoff or not
    n.cycle(["b2"])
    settle(n)
    assert len(hook.delivered()) == 2 and [r["state"] for r in ledger.notifications("b2")] == ["SENT", "SENT"]


def test_exit_sends_what_was_enqueued_while_a_batch_was_under_way(tmp_path, hook):
    ledger = Ledger.open(tmp_path / "ledger.db")
    experiment(ledger, "c1", {"webhook": hook.url, "on": ALL, "timeout_s": 5.0})
    ledger.event("c1", "watcher.failed", "test: one", idx=0)
    hook.sleep_s = 0.5
    n = Notifier(ledger, "w")
    n.cycle(["c1"])
    assert n.in_flight
    ledger.event("c1", "experiment.state", "test: completed", old="RUNNING", new="COMPLETED")
    n.cycle(["c1"])  # enqueued, not sent: the batch is under way
    assert {r["state"] for r in ledger.notifications("c1")} == {"PENDING"} and len(ledger.notifications("c1")) == 2
    n.close(grace_s=20.0)
    assert [r["state"] for r in ledger.notifications("c1")] == ["SENT", "SENT"]
    assert [b["orchestrate"]["trigger"] for b in hook.delivered()] == ["needs_attention", "completed"]


def test_exit_says_what_is_left_pending(tmp_path, caplog):
    from orchestrator.notify.webhook import Sender

    ledger = Ledger.open(tmp_path / "ledger.db")
    experiment(ledger, "c2", {"webhook": "http://127.0.0.1:9/hook", "on": ALL, "timeout_s": 5.0})
    ledger.event("c2", "watcher.failed", "test: one", idx=0)
    gate = Gate()
    n = Notifier(ledger, "w", sender=Sender(gate))
    n.cycle(["c2"])
    ledger.event("c2", "watcher.failed", "test: two", idx=0)
    n.cycle(["c2"])
    with caplog.at_level("WARNING", logger="orchestrator.notify.outbox"):
        n.close(grace_s=0.2)
    gate.open.set()
    assert "2 notifications still pending; `orchestrate watch` sends them" in caplog.text
    assert ledger.lease(outbox.LEASE + "c2") is None


# ---------------------------------------------------------------- review fixes: the smaller ones


def test_an_illegal_transition_is_no_trigger():
    assert "ledger.illegal_transition" not in triggers.NEEDS_ATTENTION_KINDS
    assert triggers.trigger_of({"kind": "ledger.illegal_transition"}) is None


@pytest.mark.parametrize("status, retry_after, wait", [
    (429, "600", 600.0),  # the server's word, longer than the backoff
    (429, "99999999", outbox.BACKOFF_MAX_S),  # capped
    (503, "5", outbox.backoff_s(1)),  # shorter than the backoff: the backoff stands
    (408, None, outbox.backoff_s(1)),
    (425, "Wed, 21 Oct 2015 07:28:00 GMT", outbox.backoff_s(1)),  # the date form is not read
])
def test_retryable_refusals_and_retry_after(tmp_path, hook, status, retry_after, wait):
    clock = Clock()
    ledger = Ledger.open(tmp_path / "ledger.db", clock=clock)
    experiment(ledger, "r2", {"webhook": hook.url, "on": ALL, "timeout_s": 5.0}, n=2)
    for i in range(2):
        ledger.event("r2", "watcher.failed", f"test: {i}", idx=i)
    hook.statuses = [status]
    hook.headers = {"Retry-After": retry_after} if retry_after else {}
    n = Notifier(ledger, "w")
    n.cycle(["r2"])
    settle(n)
    rows = ledger.notifications("r2")
    assert [(r["state"], r["attempts"], r["next_at"]) for r in rows] == [("PENDING", 1, clock.t + wait)] * 2
    assert len(hook.requests) == 1 and f"HTTP {status}" in rows[0]["last_error"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_sender_thread_that_died_is_started_again(tmp_path, hook):
    from orchestrator.notify.webhook import Sender, post

    class Dies:
        def __init__(self):
            self.calls = 0

        def __call__(self, job):
            self.calls += 1
            if self.calls == 1:
                raise SystemExit  # not an Exception: the thread ends without a word
            return post(job)

    ledger = Ledger.open(tmp_path / "ledger.db")
    experiment(ledger, "z1", {"webhook": hook.url, "on": ALL, "timeout_s": 5.0})
    ledger.event("z1", "watcher.failed", "test: one", idx=0)
    sender = Sender(Dies())
    n = Notifier(ledger, "w", sender=sender)
    n.cycle(["z1"])
    sender._thread.join(10)
    assert n.in_flight and not sender._thread.is_alive()
    n.cycle(["z1"])  # sees it dead: the batch is handed over again
    settle(n)
    assert len(hook.delivered()) == 1 and ledger.notifications("z1")[0]["state"] == "SENT"


def test_email_only_experiments_leave_the_backlog(tmp_path):
    ledger = Ledger.open(tmp_path / "ledger.db")
    experiment(ledger, "m2", {"email": "me@example.org", "on": ALL, "timeout_s": 5.0})
    ledger.event("m2", "watcher.failed", "test: one", idx=0)
    assert ledger.notify_backlog(outbox.CURSOR) == ["m2"]
    Notifier(ledger, "w").cycle([], backlog=True)
    assert ledger.notify_backlog(outbox.CURSOR) == [] and ledger.notifications("m2") == []


def test_the_cursor_stays_where_it_was_when_enqueue_fails(tmp_path, monkeypatch):
    ledger = Ledger.open(tmp_path / "ledger.db")
    experiment(ledger, "q1", {"webhook": "http://127.0.0.1:9/hook", "on": ALL, "timeout_s": 5.0})
    ledger.event("q1", "watcher.failed", "test: one", idx=0)
    n = Notifier(ledger, "w")
    exp, cfg = n._experiment("q1")

    def fails(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ledger, "set_cursor", fails)  # after the rows were written, in the same transaction
    with pytest.raises(RuntimeError):
        n.enqueue(exp, cfg)
    monkeypatch.undo()
    assert ledger.cursor(outbox.CURSOR + "q1") == 0 and ledger.notifications("q1") == []
    assert n.enqueue(exp, cfg) == 1 and ledger.cursor(outbox.CURSOR + "q1") > 0


# ---------------------------------------------------------------- end to end: real runs, a real watcher, a real server


@pytest.mark.multiproc
def test_real_runs_post_exactly_one_message_per_configured_event(tmp_path, home, hook):
    """Two experiments as a user runs them (`submit --wait`: its own watcher): user code that
    raises at step 3 (restarted in place once, then failed), and one that completes."""
    base = ("steps: 30\nbatch: {{micro_batch_size: 4}}\nheartbeat: {{interval_s: 0.5}}\n"
            "resources: {{tasks_per_node: 2, cpus_per_task: 1}}\nworkdir: {wd}\n"
            "notify: {{webhook: '{url}', on: [failed, recovered, completed, needs_attention]}}\n")
    common = base.format(wd=tmp_path / "runs", url=hook.url)
    bug = write(tmp_path / "bug.yaml", "name: bug\nmodel: {kind: entrypoint, entrypoint: 'faulty:raises_at'}\n" + common)
    fine = write(tmp_path / "fine.yaml", "name: fine\nmodel: {n_layer: 1, d_model: 32, n_head: 2, seq_len: 16}\n" + common)
    out = cli("submit", str(bug), "--executor", "local", "--wait", home=home, timeout=300)
    assert out.returncode != 0, out.stdout  # the experiment failed, as designed
    out = cli("submit", str(fine), "--executor", "local", "--wait", home=home, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = sorted((m["orchestrate"]["name"], m["orchestrate"]["trigger"], m["orchestrate"]["kind"]) for m in hook.delivered())
    assert got == [("bug", "failed", "task.state"), ("bug", "needs_attention", "experiment.state"),
                   ("bug", "recovered", "attempt.restarted"), ("fine", "completed", "experiment.state")], got
    assert all(r["type"] == "application/json" and r["path"] == "/services/T0/B0/secret" for r in hook.requests)
    ledger = Ledger.open(home / "ledger.db")
    sent = [e for exp in ledger.find_experiments() for e in ledger.events(exp["id"]) if e["kind"] == "notify.sent"]
    assert len(sent) == 4 and not any(hook.url in e["cause"] or "secret" in e["cause"] for e in sent)
