"""What can be checked of a ``kind: command`` before anything is queued: that the program
exists, and that the files and folders its arguments name, where an argument is plainly
a path to read (a data set, a model folder, a tool's config file), exist. The rest of the
command line is the program's own: said as not checked, never guessed at."""

from __future__ import annotations

import os
import shutil

from orchestrator.spec.workload import PYTHONS

# options whose value a training program reads: a data set, a model folder
READ_FLAGS = frozenset({"--dataset_name", "--dataset-name", "--data", "--data_path", "--data-path", "--dataset",
                        "--train_file", "--train-file", "--model_name_or_path", "--model-name-or-path", "--model"})
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")  # a tool's config file (axolotl train X.yml, llamafactory-cli train X.yaml)
NOT_CHECKED = "the options of model.argv: the program's own (its program and the paths it reads were checked)"


def _a_path(value: str) -> bool:
    """Written as a path, not a name a program may resolve otherwise (a hub id, a split)."""
    return value.startswith(("/", "./", "../", "~")) or value in (".", "..")


def read_paths(argv: list[str]) -> list[tuple[int, str, str]]:
    """(index in argv, value, why) of the arguments the program reads as files or folders."""
    out = []
    for i, arg in enumerate(argv[1:], start=1):
        flag, eq, value = arg.partition("=")
        if eq and flag in READ_FLAGS and _a_path(value):
            out.append((i, value, f"named by {flag}"))
        elif argv[i - 1] in READ_FLAGS and _a_path(arg):
            out.append((i, arg, f"named by {argv[i - 1]}"))
        elif not arg.startswith("-") and arg.endswith(CONFIG_SUFFIXES) and not argv[i - 1].startswith("-"):
            out.append((i, arg, "a config file"))
    return out


def problems(argv: list[str], cwd: str, env_path: str | None) -> list[tuple[int, str]]:
    """(index in argv, what is wrong) for ``argv`` run from ``cwd`` with ``PATH`` ``env_path``."""
    found = []
    program = argv[0]
    if "/" not in program and program not in PYTHONS and shutil.which(program, path=env_path) is None:
        found.append((0, f"no program '{program}' on PATH: install it, or give its path "
                         "(a tool in its own virtual environment: VENV/bin/" + program + ")"))
    for i, value, why in read_paths(argv):
        path = os.path.join(cwd, os.path.expanduser(value))
        if not os.path.exists(path):
            found.append((i, f"no file or folder '{os.path.normpath(path)}' ({why}; relative paths start at model.cwd)"))
    return found
