"""The CLI's layout promises: the entry point imports only the standard library (each
command's module is imported when it runs), every command has a handler, and the read
commands behave as documented when run in-process."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from orchestrator import contract
from orchestrator.cli.main import COMMANDS, handler, main
from orchestrator.cli.parser import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_entry_point_imports_only_the_standard_library():
    code = (
        "import sys; before = set(sys.modules); import orchestrator.cli.main; "
        "print('\\n'.join(sorted(set(sys.modules) - before)))"
    )
    new = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    foreign = [m for m in new if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "orchestrator"]
    assert not foreign, foreign
    ours = {m for m in new if m.startswith("orchestrator.")}
    assert ours <= {"orchestrator.cli", "orchestrator.cli.main", "orchestrator.cli.parser", "orchestrator.errors"}, ours


def test_every_command_has_a_handler():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert list(sub.choices) == ["validate", "schema", "plan", "submit", "watch", "status", "logs", "events", "report", "ckpt", "data", "cancel"]
    assert set(sub.choices) == set(COMMANDS)
    for command in COMMANDS:
        assert callable(handler(command)), command


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A ledger with one submitted (never started) local experiment whose rank 0 has logged a line."""
    from orchestrator.ledger import access
    from orchestrator.submit import submission

    spec = tmp_path / "exp.yaml"
    spec.write_text(f"name: light\nsteps: 3\nworkdir: {tmp_path / 'runs'}\n")
    home = tmp_path / "home"
    monkeypatch.setenv("ORCHESTRATE_HOME", str(home))
    plan = submission.make_plan(str(spec), [], "local", home)
    submission.write_run_folder(plan)
    access.open_ledger(home).create_experiment(
        {"id": plan.experiment_id, "name": plan.name, "executor": "local", "spec_path": str(spec),
         "run_dir": str(plan.run_dir), "spec": "{}"},
        [{"idx": t.index, "params": t.params, "task_dir": str(t.task_dir)} for t in plan.tasks],
    )
    log = contract.log_path(plan.tasks[0].task_dir, 0)
    log.parent.mkdir(parents=True)
    log.write_text("step 1 loss 3.0\n")
    return home


def test_status_of_an_empty_ledger_says_how_to_start(tmp_path, capsys):
    assert main(["--home", str(tmp_path), "status"]) == 0
    assert capsys.readouterr().out == "no experiments yet; start one with `orchestrate submit SPEC`\n"


def test_logs_prints_the_log_and_names_what_is_missing(home, capsys):
    assert main(["logs", "light"]) == 0
    assert capsys.readouterr().out == "step 1 loss 3.0\n"
    assert main(["logs", "light", "--task", "4"]) == 2
    assert "has tasks 0..0, not 4" in capsys.readouterr().err
    assert main(["logs", "light", "--rank", "3"]) == 2
    assert "error: no log for task 0 rank 3 yet" in capsys.readouterr().err


def test_an_unknown_experiment_is_a_user_error(home, capsys):
    for argv in (["events", "nope"], ["logs", "nope"], ["cancel", "nope"]):
        assert main(argv) == 2
        assert capsys.readouterr().err.startswith("error: no experiment with id or name 'nope' (known names: light)")


def _doc(n: int, reason: str = "") -> dict:
    tasks = [{"index": i, "params": {"optimizer.lr": 10.0 ** -i}, "state": "RUNNING" if i % 2 else "COMPLETED", "attempts": 1,
              "restarts": 0, "step": 10 * i, "loss": 1.0 / (i + 1), "eval_loss": None, "throughput": 1234.5, "goodput": 0.5 if i % 2 else None,
              "heartbeat_age_s": 3.0, "nodes": ["n1", "n2"], "checkpoint": "step-00000010", "reason": reason}
             for i in range(n)]
    return {"experiments": [{"name": "sweep", "id": "e1", "state": "RUNNING", "executor": "slurm", "watcher": None, "tasks": tasks}]}


def _print(doc: dict, width: int) -> list[str]:
    import io

    from rich.console import Console

    from orchestrator.cli import render

    out = io.StringIO()
    Console(file=out, width=width).print(*render.status_tables(doc))
    return out.getvalue().splitlines()


def test_a_sweep_prints_one_aligned_line_per_task_cropped_at_the_terminal():
    from orchestrator.cli import render

    n = render.LINES_FROM
    lines = _print(_doc(n, reason="\x1b[2J[bold]boom[/] " + "y" * 300), 140)
    assert lines[0] == "sweep e1 RUNNING (slurm)"
    head, rows, caption = lines[1], lines[2:2 + n], lines[2 + n:]
    assert head.split() == ["task", "params", "state", "att", "rst", "step", "loss", "eval", "thru/s", "goodput", "hb", "age/hang", "nodes", "checkpoint", "reason"]
    assert [r.split()[0] for r in rows] == [str(i) for i in range(n)]
    for col in ("state", "step", "checkpoint", "reason"):  # every column starts where its header does
        at = head.index(col)
        assert all(r[at - 1] == " " and r[at] != " " for r in rows), col
    assert all(len(r) == 140 and r.endswith("…") for r in rows)  # the long reason is cut at the edge, not wrapped
    assert "\\x1b[2J[bold]boom[/" in rows[0] and "\x1b" not in "".join(lines)  # escaped, not read as markup
    assert rows[3].split()[:3] == ["3", "optimizer.lr=0.001", "RUNNING"] and rows[3].split()[9] == "50%"
    assert caption == ["no watcher: hangs and failures are recovered only while `orchestrate watch` runs"]


def test_a_few_tasks_keep_the_boxed_table_that_folds_long_values():
    from orchestrator.cli import render

    lines = _print(_doc(render.LINES_FROM - 1, reason="q" * 300), 120)
    assert lines[1].startswith("┏") and sum("q" in ln for ln in lines) > render.LINES_FROM - 1  # folded over lines
    assert sum(ln.count("q") for ln in lines) == 300 * (render.LINES_FROM - 1)  # nothing cut
