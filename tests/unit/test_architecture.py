"""The layout's promises: the contract is stdlib only and the one thing train_entry
imports from orchestrator; packages import only packages below them in ``LAYERS``, in
function-level imports too; no module uses another module's private names; no
module-level import cycles; read commands never import torch (so they start fast on a
login node)."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

from conftest import CHILD_TIMEOUT_S

from orchestrator import contract

ROOT = pathlib.Path(__file__).resolve().parents[2]


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


# The packages from the ground floor up (the same list, with what each holds, is
# docs/design/architecture.md, "Package order"). A package may import only itself and the packages before it
# here: at module level, inside a function or under TYPE_CHECKING alike (a lazy import is for
# start-up time, never a way around the order). Two packages importing each other is then
# always one import upward. A top-level module (errors.py) is a package of its own here;
# train_entry is one: the compute side, whose own order is not yet stated.
LAYERS = [
    "orchestrator",  # the root package itself: its __init__ holds only the version
    "orchestrator.contract",  # stdlib only: the ground floor of both sides
    "train_entry",  # compute side; the login side runs its code in functions (ckpt consolidate, plan, submitit's entry)
    "orchestrator.errors",
    "orchestrator.states",
    "orchestrator.backoff",
    "orchestrator.spec",
    "orchestrator.ledger",
    "orchestrator.checkpoints",
    "orchestrator.scheduler",
    "orchestrator.submit",
    "orchestrator.runfolder",
    "orchestrator.evaluate",  # the watcher's evaluations of checkpoints: their processes and ledger rows
    "orchestrator.report",
    "orchestrator.notify",
    "orchestrator.supervise",
    "orchestrator.cli",
    "orchestrator.__main__",
]
# (importer, imported): why this import may point upward. Keep it short; none today.
EXCEPTIONS: dict[tuple[str, str], str] = {}
FIRST_PARTY = ("orchestrator", "train_entry")


def _all_modules() -> dict[str, pathlib.Path]:
    return {**_modules("orchestrator"), **_modules("train_entry")}


def _package_of(module: str) -> str:
    """The package of LAYERS a module belongs to: train_entry as a whole, else the root
    package or the child of orchestrator it is in."""
    parts = module.split(".")
    return "train_entry" if parts[0] == "train_entry" else ".".join(parts[:2])


def _under_function_or_type_checking(tree: ast.AST) -> set[int]:
    """ids of the import nodes that do not run when their module is imported: inside a
    function, or under ``if TYPE_CHECKING:``."""
    out: set[int] = set()

    def walk(node: ast.AST, deferred: bool) -> None:
        for child in ast.iter_child_nodes(node):
            d = deferred or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(node, ast.If) and child in node.body and "TYPE_CHECKING" in ast.unparse(node.test):
                d = True
            if isinstance(child, (ast.Import, ast.ImportFrom)) and d:
                out.add(id(child))
            walk(child, d)

    walk(tree, False)
    return out


def _from_base(node: ast.ImportFrom, module: str, path: pathlib.Path) -> str:
    """The absolute module a ``from ... import`` names (a relative one resolved)."""
    if not node.level:
        return node.module or ""
    pkg = (module if path.name == "__init__.py" else module.rpartition(".")[0]).split(".")
    return ".".join(pkg[: len(pkg) - (node.level - 1)] + ([node.module] if node.module else []))


def _first_party_imports(module: str, path: pathlib.Path, known: set[str]) -> list[tuple[int, str, bool]]:
    """(line, imported module, runs at import time) for each first-party import of a module;
    ``from pkg import mod`` names ``pkg.mod``, relative imports are resolved."""
    tree = ast.parse(path.read_text())
    deferred = _under_function_or_type_checking(tree)
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            base = _from_base(n, module, path)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in n.names]
        else:
            continue
        out += [(n.lineno, name, id(n) not in deferred) for name in dict.fromkeys(names) if name.split(".")[0] in FIRST_PARTY]
    return out


def test_every_package_has_a_place_in_the_order():
    packages = {_package_of(m) for m in _all_modules()}
    missing = sorted(packages - set(LAYERS))
    assert not missing, f"add each package to LAYERS (and the Package order of docs/design/architecture.md), above what it imports: {missing}"
    assert not set(LAYERS) - packages, f"LAYERS names packages that are gone: {sorted(set(LAYERS) - packages)}"
    assert len(set(LAYERS)) == len(LAYERS)


def test_packages_import_only_packages_below_them():
    mods = _all_modules()
    rank = {p: i for i, p in enumerate(LAYERS)}
    upward, used = [], set()
    for module, path in sorted(mods.items()):
        mine = _package_of(module)
        for line, imported, _ in _first_party_imports(module, path, set(mods)):
            theirs = _package_of(imported)
            if rank.get(theirs, -1) <= rank.get(mine, -1):
                continue
            if (mine, theirs) in EXCEPTIONS:
                used.add((mine, theirs))
                continue
            upward.append(f"{path.relative_to(ROOT)}:{line} imports {imported}: {mine} may import only packages "
                          f"below it in LAYERS, and {theirs} is above it")
    assert not upward, "imports upward (move the shared piece below both, or name an exception with its reason):\n" + "\n".join(upward)
    assert used == set(EXCEPTIONS), f"exceptions no import needs any more: {sorted(set(EXCEPTIONS) - used)}"


def test_the_login_side_runs_compute_code_only_inside_functions():
    """Importing an orchestrator module loads none of train_entry (nor torch with it): a
    command that consolidates or plans memory imports it where it needs it."""
    mods = _all_modules()
    eager = [f"{path.relative_to(ROOT)}:{line} imports {imported} at module level"
             for module, path in sorted(_modules("orchestrator").items())
             for line, imported, at_import in _first_party_imports(module, path, set(mods))
             if at_import and imported.split(".")[0] == "train_entry"]
    assert not eager, eager


# ---------------------------------------------------------------- private names
#
# A name that starts with one underscore (dunders aside) belongs to the module that defines
# it. Checked over orchestrator/, train_entry/ and bench/ (tests may test private helpers):
#   1. ``from m import _x`` where m is one of those modules;
#   2. ``m._x`` where m is bound by an import to one of those modules;
#   3. ``obj._x`` (obj anything but self or cls) where _x is a private attribute or method of a
#      class of another of those modules (assigned as self._x, or defined in its body) and of
#      no class of this module: statically, by name, so what it cannot see (getattr, a private
#      name that classes of both modules define) it does not flag. Other libraries' private
#      names are theirs to keep stable, not this test's.

PRIVATE_SCOPE = ("orchestrator", "train_entry", "bench")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _class_privates(tree: ast.AST) -> set[str]:
    """Private attribute and method names the classes of a module define."""
    out = set()
    for cls in (c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)):
        for n in cls.body:  # methods and class attributes
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                out |= {t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        out |= {n.attr for n in ast.walk(cls)  # instance attributes: self._x = ...
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")}
    return {n for n in out if _private(n)}


def private_reach_ins(roots: tuple[str, ...] = PRIVATE_SCOPE) -> list[str]:
    mods = {m: p for r in roots for m, p in _modules(r).items()}
    trees = {m: ast.parse(p.read_text()) for m, p in mods.items()}
    owners: dict[str, set[str]] = {}
    for m, tree in trees.items():
        for name in _class_privates(tree):
            owners.setdefault(name, set()).add(m)
    found: list[tuple[str, int, str]] = []
    for m, tree in trees.items():
        where = f"{mods[m].relative_to(ROOT)}"
        aliases = {}  # local name -> the module of ours it is bound to
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                base = _from_base(n, m, mods[m])
                for a in n.names:
                    if base in mods and _private(a.name):
                        found.append((where, n.lineno, f"imports {a.name} from {base}"))
                    if f"{base}.{a.name}" in mods:
                        aliases[a.asname or a.name] = f"{base}.{a.name}"
            elif isinstance(n, ast.Import):
                aliases.update({a.asname: a.name for a in n.names if a.asname and a.name in mods})
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Attribute) and _private(n.attr)):
                continue
            target = n.value.id if isinstance(n.value, ast.Name) else None
            owner = aliases.get(target) or (ast.unparse(n.value) if ast.unparse(n.value) in mods else None)  # m._x, pkg.m._x
            if owner is not None and owner != m:
                found.append((where, n.lineno, f"uses {ast.unparse(n.value)}.{n.attr}, private to {owner}"))
            elif target not in ("self", "cls") and (theirs := owners.get(n.attr, set())) and m not in theirs:
                found.append((where, n.lineno, f"uses {ast.unparse(n.value)}.{n.attr}, private to a class of {', '.join(sorted(theirs))}"))
    return [f"{where}:{line} {what}" for where, line, what in sorted(found)]


def test_no_module_uses_another_modules_private_names():
    found = private_reach_ins()
    assert not found, "private names used across modules (give the owner a public name or method):\n" + "\n".join(found)


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
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
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
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
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


# ---------------------------------------------------------------- small modules, short functions

MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60
# "path" (a module) or "path:function" -> why it may be longer
SIZE_EXCEPTIONS = {
    "orchestrator/ledger/migrations.py:_m001_initial": "one migration's DDL, read as a schema",
}


def test_modules_and_functions_are_small_or_say_why():
    """No module over MAX_MODULE_LINES lines, no function (its docstring included) over
    MAX_FUNCTION_LINES, but the named exceptions; an exception that no longer applies goes."""
    long = {}
    for path in sorted(p for top in FIRST_PARTY for p in (ROOT / top).rglob("*.py")):
        rel, text = path.relative_to(ROOT).as_posix(), path.read_text()
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            long[rel] = n
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    long[f"{rel}:{node.name}"] = n
    assert {k: n for k, n in long.items() if k not in SIZE_EXCEPTIONS} == {}, "split them, or name them in SIZE_EXCEPTIONS with a reason"
    assert sorted(set(SIZE_EXCEPTIONS) - set(long)) == [], "no longer long: drop them from SIZE_EXCEPTIONS"
