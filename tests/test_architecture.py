"""The layout's promises: the contract is stdlib only and the one thing train_entry
imports from orchestrator; no module-level import cycles; read commands never import
torch (so they start fast on a login node)."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

from orchestrator import contract

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path, top_level_only: bool = False) -> set[str]:
    """Absolute names a module imports (relative ones resolved against its package)."""
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1]) if path.name != "__init__.py" else ".".join(path.relative_to(ROOT).parts[:-1])
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                base = ".".join(parts + ([n.module] if n.module else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in n.names}  # `from pkg import module`
    return out


def _modules(package: str) -> dict[str, pathlib.Path]:
    out = {}
    for f in (ROOT / package).rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def test_contract_is_stdlib_only():
    for name, f in _modules("orchestrator/contract").items():
        for imp in _imports(f):
            top = imp.split(".")[0]
            assert top in sys.stdlib_module_names or top == "__future__" or imp.startswith("orchestrator.contract"), f"{name} imports {imp}"
    # and at run time: importing it pulls in nothing outside the standard library
    code = (
        "import sys; before = set(sys.modules); import orchestrator.contract; "
        "print('\\n'.join(sorted(m for m in set(sys.modules) - before)))"
    )
    new = subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    foreign = [m for m in new if m.split(".")[0] not in sys.stdlib_module_names and not m.startswith("orchestrator")]
    assert not foreign, foreign
    assert not [m for m in new if m.startswith("orchestrator.") and not m.startswith("orchestrator.contract")]


def test_train_entry_imports_only_the_contract_from_orchestrator():
    for name, f in _modules("train_entry").items():
        for imp in _imports(f):
            if imp == "orchestrator" or imp.startswith("orchestrator."):
                assert imp in ("orchestrator", "orchestrator.contract") or imp.startswith("orchestrator.contract."), f"{name} imports {imp}"


def test_no_module_level_import_cycles():
    mods = {**_modules("orchestrator"), **_modules("train_entry")}
    graph = {m: {i for i in _imports(f, top_level_only=True) if i in mods and i != m} for m, f in mods.items()}
    # a package's own __init__ importing its submodules is not a cycle of substance
    for m in graph:
        graph[m] = {i for i in graph[m] if not m.startswith(i + ".")}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, cycles


@pytest.fixture(scope="module")
def one_experiment(tmp_path_factory):
    """A ledger with one submitted (never started) local experiment, made in-process."""
    from orchestrator.ledger import access
    from orchestrator.submit import submission

    base = tmp_path_factory.mktemp("arch")
    spec = base / "exp.yaml"
    spec.write_text(f"name: light\nsteps: 3\nworkdir: {base / 'runs'}\n")
    home = base / "home"
    plan = submission.make_plan(str(spec), [], "local", home)
    ledger = access.open_ledger(home)
    submission.write_run_folder(plan)
    ledger.create_experiment(
        {"id": plan.experiment_id, "name": plan.name, "executor": "local", "spec_path": str(spec),
         "run_dir": str(plan.run_dir), "spec": "{}"},
        [{"idx": t.index, "params": t.params, "task_dir": str(t.task_dir)} for t in plan.tasks],
    )
    ledger.add_attempt(plan.experiment_id, 0, "12345_0", "test")
    log = contract.log_path(plan.tasks[0].task_dir, 0)
    log.parent.mkdir(parents=True)
    log.write_text("step 1 loss 3.0\n")
    return spec, home


def heavy_modules(argv: list[str]) -> tuple[str, ...]:
    """What a command must not import: torch and its kin for all; the spec's models
    (pydantic), YAML and numpy too for those that only read the ledger."""
    heavy = ("torch", "deepspeed", "transformers", "peft", "safetensors")
    return heavy if argv[0] == "validate" else heavy + ("pydantic", "yaml", "numpy")


@pytest.mark.parametrize(
    "argv",
    [["validate", "{spec}"], ["status"], ["status", "light", "--json"], ["events", "light"], ["logs", "light"], ["cancel", "light"]],
)
def test_read_commands_import_only_what_they_use(one_experiment, argv):
    spec, home = one_experiment
    argv = [a.format(spec=spec) for a in argv]
    code = (
        "import sys, atexit, json; from orchestrator.cli.main import main\n"
        f"HEAVY = {heavy_modules(argv)!r}\n"
        "atexit.register(lambda: print('\\nMODULES ' + json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in HEAVY))))\n"
        f"sys.exit(main({argv!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "ORCHESTRATE_HOME": str(home)})
    assert out.returncode == 0, out.stdout + out.stderr
    heavy = json.loads(out.stdout.rsplit("MODULES ", 1)[1])
    assert heavy == [], f"orchestrate {' '.join(argv)} imported {heavy}"


def test_status_of_finished_experiments_reads_without_sqlite_utils(tmp_path):
    """Reading is plain SQL; sqlite-utils (a fifth of the start-up) loads only to write."""
    from orchestrator.ledger import Ledger
    from orchestrator.states import TaskState

    ledger = Ledger.open(tmp_path / "ledger.db")
    ledger.create_experiment({"id": "done1", "name": "done", "executor": "local", "spec_path": "s.yaml", "run_dir": str(tmp_path / "r"),
                              "spec": "{}"}, [{"idx": 0, "params": {"lr": 0.1}, "task_dir": str(tmp_path / "r" / "0")}])
    ledger.add_attempt("done1", 0, "1_0", "test")
    ledger.set_task_state("done1", 0, TaskState.RUNNING, "started")
    ledger.set_task_state("done1", 0, TaskState.COMPLETED, "ended")
    ledger.close()
    code = ("import sys, atexit; from orchestrator.cli.main import main\n"
            "atexit.register(lambda: print('\\nLOADED', 'sqlite_utils' in sys.modules))\n"
            "sys.exit(main(['status', 'done']))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "ORCHESTRATE_HOME": str(tmp_path)})
    assert out.returncode == 0 and "COMPLETED" in out.stdout, out.stdout + out.stderr
    assert out.stdout.rsplit("LOADED ", 1)[1].strip() == "False"


def test_polling_slurm_imports_no_spec_models():
    """A `status` of a SLURM experiment asks squeue and sacct; the batch script's half
    (slurm_script, with the spec's pydantic models) is imported only to submit."""
    code = ("import sys; from orchestrator.cli import render; from orchestrator.supervise import refresh; "
            "from orchestrator.scheduler import slurm; print(sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'yaml', 'numpy', 'submitit'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
