"""The report document as one self-contained HTML page: inline SVG figures and CSS, no
script, nothing fetched when it is opened. Every text from the ledger or a record is
escaped (a trainer's event cause is not trusted)."""

from __future__ import annotations

import datetime
from html import escape

from orchestrator.report import plots
from orchestrator.report.goodput import CATEGORIES

CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 32px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
td, th { border: 1px solid #ddd; padding: 3px 6px; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
.figure svg { max-width: 100%; height: auto; }
.muted { color: #777; } .FAILED { color: #c62828; } .COMPLETED { color: #2e7d32; }
"""
EVENTS_SHOWN = 2000  # rows of the events table (the rest: `orchestrate events`)


def _t(value) -> str:
    return escape("" if value is None else str(value))


def _n(value, fmt: str = ",.1f") -> str:
    return "-" if value is None else format(value, fmt)


def _when(t: float | None) -> str:
    try:
        return "-" if t is None else datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")
    except (ValueError, OverflowError, OSError):  # a record's time out of any calendar
        return _t(t)


def _table(head: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    h = "".join(f"<th>{_t(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(r)) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def _figure(fig_id: str, svg: str | None) -> str:
    return "" if not svg else f'<div class="figure" id="{fig_id}">{svg}</div>'


def _breakdown_table(doc: dict) -> str:
    """The experiment's allocated time by category, then the time outside the allocation."""
    tot = doc["totals"]
    alloc = tot["allocated_s"] or 0.0
    node_per_s = tot["node_hours"] / alloc if alloc else 0.0
    gpu_per_s = tot["gpu_hours"] / alloc if alloc else 0.0
    rows = [[_t(plots.LABELS[c]), _n(tot["seconds"][c]), f"{100 * tot['seconds'][c] / alloc:.1f} %" if alloc else "-",
             _n(tot["seconds"][c] * node_per_s, ",.4f"), _n(tot["seconds"][c] * gpu_per_s, ",.4f")] for c in CATEGORIES]
    rows.append(["<b>allocated</b>", _n(alloc), "100 %", _n(tot["node_hours"], ",.4f"), _n(tot["gpu_hours"], ",.4f")])
    rows += [[_t(label), _n(tot[key]), "outside", "", ""] for key, label in (
        ("queued_s", "queued before the first attempt"), ("requeue_queued_s", "queued after a requeue"),
        ("watcher_detection_s", "an attempt's end to the watcher's noticing it"))]
    return _table(["", "seconds", "share", "node-hours", "GPU-hours"], rows, numeric={1, 2, 3, 4})


def _task_goodput_table(doc: dict) -> str:
    rows = []
    for t in doc["tasks"]:
        g = t["goodput"]
        lost = sum(g["seconds"][c] for c in ("recomputed", "failure_detection"))
        rows.append([_t(t["index"]), _n(g["allocated_s"]), "-" if g["goodput"] is None else f"{100 * g['goodput']:.1f} %",
                     _n(g["seconds"]["productive"]), _n(g["seconds"]["startup"] + g["seconds"]["checkpoint_load"]),
                     _n(g["seconds"]["checkpoint_blocked"]), _n(lost), _t(g["steps_recomputed"]), _n(g["step_time_s"], ",.4f"),
                     _t(len(t["faults"]))])
    return _table(["task", "allocated s", "goodput", "productive s", "start-up and load s", "checkpoint blocked s",
                   "recomputed and detection s", "steps recomputed", "step s", "faults"], rows, numeric=set(range(1, 10)))


def _kinds_table(doc: dict) -> str:
    kinds = doc["by_failure_kind"]
    if not kinds:
        return '<p class="muted">No failure.</p>'
    cats = sorted({c for k in kinds.values() for c in k["lost_s"]})
    rows = [[_t(k), _t(v["count"]), _n(v["lost_total_s"]), _n(v["per_fault_s"], ",.1f")] + [_n(v["lost_s"].get(c, 0.0)) for c in cats]
            + [_n(v["queued_s"])] for k, v in sorted(kinds.items())]
    return _table(["failure kind", "faults", "lost s", "per fault s"] + [plots.LABELS.get(c, c) + " s" for c in cats]
                  + ["queued s (outside)"], rows, numeric=set(range(1, 5 + len(cats))))


def projection_line(p: dict | None) -> str:
    """The projection of ``report --mtbf``, as a sentence (the page's and the command's)."""
    if not p:
        return ""
    if p["goodput"] is None:
        return "No allocated time to project from."
    every = f"a fault every {p['mtbf_s'] / 3600:,.2f} h" if p["mtbf_s"] >= 3600 else f"a fault every {p['mtbf_s']:,.0f} s"
    if not p["faults_seen"]:
        return f"No fault in this run: nothing to say what {every} would cost; goodput without faults {100 * p['goodput']:.1f} %."
    return (f"At {every}, each costing what this run's {p['faults_seen']} cost on average ({p['per_fault_s']:,.1f} s of the "
            f"allocation, and {p['queued_per_fault_s']:,.1f} s queued): goodput {100 * p['goodput']:.1f} % "
            f"({100 * p['goodput_without_faults']:.1f} % without faults).")


def _faults_table(doc: dict) -> str:
    rows = [[_t(t["index"]), _when(f["time"]), _t(f["kind"]), _t(f["where"]), _t(f["step"]), _t(f["resumed_step"]),
             _n(sum(f["lost_s"].values()))] for t in doc["tasks"] for f in t["faults"]]
    if not rows:
        return ""
    return _table(["task", "time", "kind", "recovered", "last step done", "resumed from step", "lost s"], rows, numeric={4, 5, 6})


def _saves_table(doc: dict) -> str:
    rows = []
    for t in doc["tasks"]:
        s = t["saves"]
        if s:
            blocked = [x["blocked_s"] for x in s]
            total = [x["total_s"] for x in s if x.get("total_s") is not None]
            rows.append([_t(t["index"]), _t(len(s)), _n(sum(blocked), ",.2f"), _n(max(blocked), ",.2f"),
                         _n(sum(total) / len(total) if total else None, ",.2f")])
    if not rows:
        return '<p class="muted">No checkpoint committed.</p>'
    return _table(["task", "commits", "blocked training s (all)", "longest block s", "mean save s"], rows, numeric={1, 2, 3, 4})


def _tasks_table(doc: dict) -> str:
    rows = [[_t(t["index"]), _t(", ".join(f"{k}={v}" for k, v in t["params"].items())), f'<span class="{_t(t["state"])}">{_t(t["state"])}</span>',
             _t(len(t["attempts"])), _t(t["step"]), _n(t["final_loss"], ".4f"), _n(t["final_eval_loss"], ".4f"), _t(t["reason"])]
            for t in doc["tasks"]]
    return _table(["task", "params", "state", "attempts", "step", "loss", "eval loss", "reason"], rows, numeric={3, 4, 5, 6})


def _evaluations(doc: dict) -> list[str]:
    """Each checkpoint's evaluation against the step, and the tasks ranked by their best."""
    fig = plots.eval_figure(doc["tasks"], doc.get("ranking"))
    if fig is None:
        return []
    r = doc["ranking"]
    rows = [[_t(b["task"]), _t(", ".join(f"{k}={v}" for k, v in b["params"].items())), _t(b["step"]), _n(b["value"], ".4g")]
            for b in r["tasks"]]
    return ["<h2>Evaluations of checkpoints</h2>",
            '<p class="muted">Each metric of each evaluated checkpoint against its step; grey: the loss; star: the best by '
            f"{_t(r['metric'])} ({_t(r['mode'])}).</p>", _figure("evaluations", fig),
            f"<h3>Tasks by their best {_t(r['metric'])}</h3>", _table(["task", "params", "step", _t(r["metric"])], rows, numeric={2, 3})]


def _events_table(doc: dict) -> str:
    events = doc["events"][-EVENTS_SHOWN:]
    rows = [[_when(e["time"]), _t(e["idx"]), _t(e["attempt"]), _t(e["kind"]),
             _t(f"{e['old_state'] or ''} -> {e['new_state']}" if e["new_state"] else ""), _t(e["cause"])] for e in events]
    more = len(doc["events"]) - len(events)
    note = f'<p class="muted">{more} older events: <code>orchestrate events</code>.</p>' if more > 0 else ""
    return note + _table(["time", "task", "attempt", "event", "state", "cause"], rows)


def render(doc: dict) -> str:
    exp, tasks = doc["experiment"], doc["tasks"]
    t0 = min([a["submitted_at"] for t in tasks for a in t["attempts"] if a.get("submitted_at")] or [exp.get("created_at") or 0.0])
    tot = doc["totals"]
    good = "-" if tot["goodput"] is None else f"{100 * tot['goodput']:.1f} %"
    drawn = "" if len(tasks) <= plots.TASKS_DRAWN else f'<p class="muted">Curves of the first {plots.TASKS_DRAWN} of {len(tasks)} tasks.</p>'
    parts = [
        f"<h1>{_t(exp['name'])} <span class=\"muted\">{_t(exp['id'])}</span> <span class=\"{_t(exp['state'])}\">{_t(exp['state'])}</span></h1>",
        f"<p>{len(tasks)} task(s) on {_t(exp['executor'])}; submitted {_when(exp.get('created_at'))}; report of {_when(doc['generated_at'])}. "
        f"Goodput {good} of {_n(tot['allocated_s'])} allocated seconds ({_n(tot['node_hours'], ',.3f')} node-hours, "
        f"{_n(tot['gpu_hours'], ',.3f')} GPU-hours); {tot['steps_recomputed']} steps recomputed.</p>",
        "<h2>Tasks</h2>", _tasks_table(doc),
        "<h2>Loss</h2>", '<p class="muted">A line per pass (attempt or in-place restart); red: a fault, at the last step done; '
        "green dashes: where training resumed; dots: eval loss.</p>", drawn, _figure("loss", plots.loss_figure(tasks)),
        "<h2>Timeline</h2>", _figure("timeline", plots.timeline_figure(tasks, t0)),
        "<h2>Goodput</h2>", _figure("goodput", plots.goodput_figure(tasks, tot)), _breakdown_table(doc), _task_goodput_table(doc),
        "<h3>Lost time by failure kind</h3>", _kinds_table(doc),
        f"<p>{_t(projection_line(doc.get('projection')))}</p>" if doc.get("projection") else "", _faults_table(doc),
        "<h2>Throughput</h2>", _figure("throughput", plots.throughput_figure(tasks)),
        "<h2>Checkpoints</h2>", _saves_table(doc), _figure("saves", plots.saves_figure(tasks) if any(t["saves"] for t in tasks) else None),
    ]
    parts += _evaluations(doc)
    sweep = plots.sweep_figure(tasks, doc["sweep_keys"])
    if sweep:
        parts += ["<h2>Sweep</h2>", _figure("sweep", sweep)]
    parts += ["<h2>Events</h2>", _events_table(doc)]
    title = f"{_t(exp['name'])} {_t(exp['id'])}: orchestrate report"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
            f"<style>{CSS}</style></head><body>\n" + "\n".join(p for p in parts if p) + "\n</body></html>\n")
