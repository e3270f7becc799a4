"""The package as users get it: a wheel, installed non-editable, without the checkout.

The fast tests check pyproject.toml against the source tree, so that a new subpackage
or a new kind of template file cannot be left out of the wheel. The install test
builds the wheel, installs it with its declared dependencies only (no extras) into a
fresh virtual environment, and runs the CLI from a folder outside the checkout.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]

# The top-level templates/ folder, installed as this package (pyproject's package-dir).
TEMPLATES_PACKAGE = "orchestrator.templates"
TOP_PACKAGES = ("orchestrator", "train_entry")

# What the tool reads at run time and so must be in the wheel.
WHEEL_MUST_HAVE = (
    "orchestrator/templates/__init__.py",
    "orchestrator/templates/deepspeed/zero.json",
    "orchestrator/templates/deepspeed/large-model.json",
    "orchestrator/templates/sbatch/common.sh",
    "orchestrator/templates/sbatch/nccl.sh",
    "orchestrator/templates/sbatch/offline.sh",
    "orchestrator/py.typed",
    "train_entry/py.typed",
)

# Not part of the product; never copied for the wheel build.
_NOT_SOURCE = {".git", ".slurm-local", ".slurm-local-2", "build", "dist", "runs", ".whl", ".gl", ".pytest_cache", ".venv", "venv"}


def _source_packages() -> set[str]:
    """Every folder under the top-level packages that holds an ``__init__.py``."""
    found = set()
    for top in TOP_PACKAGES:
        for init in (REPO / top).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO)
            if "__pycache__" not in rel.parts:
                found.add(".".join(rel.parts))
    return found


def _package_folder(package: str) -> Path:
    mapped = SETUPTOOLS.get("package-dir", {})
    if package in mapped:
        return REPO / mapped[package]
    return REPO / Path(*package.split("."))


def _data_files(folder: Path) -> list[str]:
    """Files other than Python sources under ``folder``, relative to it (posix)."""
    out = []
    for p in folder.rglob("*"):
        rel = p.relative_to(folder)
        if p.is_file() and "__pycache__" not in rel.parts and p.suffix not in (".py", ".pyc"):
            out.append(rel.as_posix())
    return sorted(out)


# ---------------------------------------------------------------- fast: pyproject vs the tree


def test_the_wheel_lists_every_package_of_the_source_tree():
    listed = SETUPTOOLS["packages"]
    assert len(listed) == len(set(listed)), f"duplicates in [tool.setuptools] packages: {listed}"
    expected = _source_packages() | {TEMPLATES_PACKAGE}
    missing, extra = sorted(expected - set(listed)), sorted(set(listed) - expected)
    assert not missing and not extra, (
        f"[tool.setuptools] packages in pyproject.toml is out of date: "
        f"add {missing} (folders with an __init__.py), remove {extra}"
    )


def test_templates_folder_is_mapped_into_the_orchestrator_package():
    assert SETUPTOOLS.get("package-dir", {}).get(TEMPLATES_PACKAGE) == "templates"
    assert (REPO / "templates" / "deepspeed").is_dir() and (REPO / "templates" / "sbatch").is_dir()
    # a regular package: for a namespace package importlib.resources.files() returns a
    # MultiplexedPath, which is no file-system path (str() of it is its repr)
    assert (REPO / "templates" / "__init__.py").is_file()


def test_every_data_file_of_a_package_is_declared_package_data():
    """A template or marker file the globs do not match would silently miss the wheel."""
    patterns = SETUPTOOLS.get("package-data", {})
    unmatched = []
    for package in SETUPTOOLS["packages"]:
        globs = patterns.get(package, []) + patterns.get("*", []) + patterns.get("", [])
        for rel in _data_files(_package_folder(package)):
            # a file in a subpackage's own folder is that subpackage's business
            owner = ".".join([package, *rel.split("/")[:-1]])
            if owner != package and owner in SETUPTOOLS["packages"]:
                continue
            if not any(fnmatch.fnmatchcase(rel, g) for g in globs):
                unmatched.append(f"{package}: {rel}")
    assert not unmatched, f"not in [tool.setuptools.package-data], so not in the wheel: {unmatched}"
    for package in TOP_PACKAGES:
        assert (REPO / package / "py.typed").is_file(), f"{package}/py.typed is declared but missing"


# import name -> the distribution that provides it, where the two differ
_DISTRIBUTION_OF = {"yaml": "pyyaml", "sqlite_utils": "sqlite-utils", "pydantic_core": "pydantic"}


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("_", "-") for r in reqs}


def _third_party_imports() -> dict[str, set[str]]:
    """Top-level module -> files importing it, for imports outside the stdlib and the project."""
    out: dict[str, set[str]] = {}
    for top in TOP_PACKAGES:
        for path in (REPO / top).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    mod = name.split(".")[0]
                    if mod not in sys.stdlib_module_names and mod not in TOP_PACKAGES:
                        out.setdefault(mod, set()).add(path.relative_to(REPO).as_posix())
    return out


def test_every_imported_distribution_is_declared():
    project = PYPROJECT["project"]
    required = _requirement_names(project["dependencies"])
    optional = set().union(*(_requirement_names(r) for r in project.get("optional-dependencies", {}).values()))
    undeclared = {}
    for mod, files in _third_party_imports().items():
        dist = _DISTRIBUTION_OF.get(mod, mod).lower().replace("_", "-")
        if dist not in required | optional:
            undeclared[dist] = sorted(files)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    # torch's CPU wheel does not declare numpy, yet checkpoints and RNG states need it
    assert "numpy" in required


# ---------------------------------------------------------------- the wheel, installed


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return f"(no {path})"


def _run_logged(argv: list[str], log: Path, *, env: dict, cwd: Path, timeout: float) -> None:
    """Run a noisy command (pip), its output to ``log``; fail with the log's tail."""
    with log.open("a") as fh:
        fh.write(f"\n$ {' '.join(map(str, argv))}\n")
        fh.flush()
        try:
            rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    assert rc == 0, f"{' '.join(map(str, argv))} failed ({rc}); last lines of {log}:\n{_tail(log)}"


def _clean_env(**extra: str) -> dict:
    """The environment of a user's shell: nothing that points into the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORCHESTRATE_", "PYTHON", "VIRTUAL_ENV", "CONDA_"))}
    env["PIP_NO_INPUT"] = "1"
    env.pop("PIP_BREAK_SYSTEM_PACKAGES", None)  # a virtual environment needs no such override
    env.update(extra)
    return env


def _copy_source(dest: Path) -> Path:
    """The checkout without build leftovers and VCS data: an in-tree build would write
    build/ and *.egg-info into the checkout, and a stale build/lib would leak into the wheel."""

    def ignore(folder: str, names: list[str]) -> set[str]:
        top = Path(folder).resolve() == REPO
        return {n for n in names if n == "__pycache__" or n.endswith(".egg-info") or (top and n in _NOT_SOURCE)}

    shutil.copytree(REPO, dest, ignore=ignore, symlinks=True)
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, work, log): the wheel installed without extras into a fresh virtual
    environment; ``work`` is an empty folder outside the checkout."""
    root = tmp_path_factory.mktemp("packaging")
    assert not root.resolve().is_relative_to(REPO), "the test folder must lie outside the checkout"
    log = root / "pip.log"
    env = _clean_env()

    # 1. the wheel, as `pip install <git URL>` builds it
    src = _copy_source(root / "src")
    wheels = root / "wheels"
    _run_logged(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        log, env=env, cwd=root, timeout=300,
    )
    (wheel,) = wheels.glob("orchestrate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [n for n in WHEEL_MUST_HAVE if n not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    assert not any(n.startswith(("templates/", "tests/", "configs/")) for n in names), "checkout folders leaked into the wheel top level"
    py = {n for n in names if n.endswith(".py")}
    expected_py = {p.relative_to(REPO).as_posix() for top in TOP_PACKAGES for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts}
    assert expected_py <= py, f"modules missing from the wheel: {sorted(expected_py - py)}"

    # 2. a fresh environment: the pinned CPU torch first (the constraint the Makefile
    # relies on, so that pip never pulls CUDA builds), then the wheel without extras
    venv = root / "venv"
    _run_logged([sys.executable, "-m", "venv", str(venv)], log, env=env, cwd=root, timeout=300)
    vpy = venv / "bin" / "python"
    # --no-compile: byte-compiling all of torch costs half a minute of a core; the processes
    # below compile (and keep) only what they import
    _run_logged([str(vpy), "-m", "pip", "install", "--no-compile", "torch==2.13.0"], log, env=env, cwd=root, timeout=600)
    _run_logged([str(vpy), "-m", "pip", "install", "--no-compile", str(wheel)], log, env=env, cwd=root, timeout=600)
    _run_logged([str(vpy), "-m", "pip", "check"], log, env=env, cwd=root, timeout=120)

    work = root / "work"
    work.mkdir()
    yield venv, work, log
    # about a gigabyte (torch); pytest keeps the last few temp folders, logs and runs stay
    shutil.rmtree(venv, ignore_errors=True)
    shutil.rmtree(src, ignore_errors=True)


def _orchestrate(venv: Path, work: Path, *args: str, path: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = _clean_env(
        ORCHESTRATE_HOME=str(work / "home"),
        ORCHESTRATE_STRICT_TRANSITIONS="1",
        PATH=path or f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        VIRTUAL_ENV=str(venv),
    )
    return subprocess.run(
        [str(venv / "bin" / "orchestrate"), *args],
        capture_output=True, text=True, env=env, cwd=work, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def _show(out: subprocess.CompletedProcess) -> str:
    return f"exit {out.returncode}\n--- stdout\n{out.stdout[-6000:]}\n--- stderr\n{out.stderr[-6000:]}"


DEEPSPEED_SPEC = """\
name: ds-packaged
engine: {kind: deepspeed, stage: 2, template: large-model}
resources: {tasks_per_node: 2, setup_templates: [nccl, offline]}
steps: 10
"""


@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_the_installed_wheel_validates_plans_and_trains_outside_the_checkout(installed):
    venv, work, _ = installed

    # the installed code, not the checkout's; no extras came with it
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.resources as r, importlib.util as u, json, orchestrator, train_entry;"
         "print(json.dumps({'orchestrator': orchestrator.__file__, 'train_entry': train_entry.__file__,"
         "'templates': str(r.files('orchestrator.templates')),"
         "'extras': [m for m in ('deepspeed', 'transformers', 'peft') if u.find_spec(m)]}))"],
        capture_output=True, text=True, env=_clean_env(), cwd=work, timeout=120,
    )
    assert probe.returncode == 0, _show(probe)
    where = json.loads(probe.stdout)
    for key in ("orchestrator", "train_entry", "templates"):
        assert Path(where[key]).resolve().is_relative_to(venv.resolve()), where
    assert where["extras"] == [], f"extras were installed: {where['extras']}"

    spec = work / "ds.yaml"
    spec.write_text(DEEPSPEED_SPEC)

    # (a) a DeepSpeed spec validates: its template is found in the installed package
    out = _orchestrate(venv, work, "validate", str(spec))
    assert out.returncode == 0, _show(out)
    assert "valid" in out.stdout + out.stderr

    # (b) the dry run renders the plan and the batch script from the installed sbatch
    # fragments; without sbatch on PATH it asks no cluster
    out = _orchestrate(venv, work, "submit", str(spec), "--dry-run", "--executor", "slurm", path=str(venv / "bin"))
    assert out.returncode == 0, _show(out)
    for needle in ("experiment ds-packaged", "world size 2", "# --- common.sh", "# --- nccl.sh", "# --- offline.sh", "dry run: nothing submitted"):
        assert needle in out.stdout, f"{needle!r} not in the dry run:\n{_show(out)}"
    assert not (work / "home" / "runs").exists() or not any((work / "home" / "runs").iterdir()), "a dry run wrote a run folder"

    # (c) the smoke test, made small, past its first committed checkpoint
    quick = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    quick.update(steps=12, heartbeat={"interval_s": 1}, logging={"every_steps": 4})
    quick["checkpoint"] = {**quick.get("checkpoint", {}), "every_steps": 6}
    quick["schedule"] = {**quick.get("schedule", {}), "warmup_steps": 2}
    qspec = work / "smoke.yaml"
    qspec.write_text(yaml.safe_dump(quick, sort_keys=False))
    name = quick["name"]
    out = _orchestrate(venv, work, "submit", str(qspec), "--executor", "local", "--wait", timeout=600)
    if out.returncode != 0:
        logs = _orchestrate(venv, work, "logs", name, "--rank", "0")
        raise AssertionError(f"the smoke test failed:\n{_show(out)}\n--- rank 0 log\n{logs.stdout[-6000:]}{logs.stderr[-2000:]}")

    status = _orchestrate(venv, work, "status", name, "--json")
    assert status.returncode == 0, _show(status)
    (exp,) = json.loads(status.stdout)["experiments"]
    assert exp["state"] == "COMPLETED", exp
    (task,) = exp["tasks"]
    assert task["state"] == "COMPLETED" and task["step"] == quick["steps"], task
    run_dir = Path(exp["run_dir"])
    assert run_dir.resolve().is_relative_to((work / "home").resolve()), run_dir
    committed = sorted(p.parent.name for p in run_dir.rglob("manifest.json") if p.parent.name.startswith("step-"))
    assert committed, f"no committed checkpoint (step-*/manifest.json) under {run_dir}"
