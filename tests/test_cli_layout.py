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

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
    assert list(sub.choices) == ["validate", "schema", "plan", "submit", "watch", "status", "logs", "events", "ckpt", "cancel"]
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
