"""`eval.checkpoints` at submission: the files each kind reads made absolute and read now
(a bad prompt line, a missing task YAML, a program not found is named before anything is
queued), so the evaluations, started later by the watcher, find what was checked."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import yaml

from orchestrator.errors import SpecError
from orchestrator.spec import yamlsrc
from orchestrator.spec.load import set_path
from orchestrator.submit import command_check
from orchestrator.submit.paths import local_path

FIELD = ("eval", "checkpoints")


def check(spec, here: Path, raw: dict, lines: dict, source: str) -> None:
    ce = spec.eval.checkpoints
    if ce is None:
        return

    def refuse(path: tuple, message: str) -> SpecError:
        return SpecError([yamlsrc.issue(lines, (*FIELD, *path), message, source)])

    if spec.model.kind not in ("hf", "script", "command"):
        raise refuse((), f"model kind {spec.model.kind} has no Hugging Face export to evaluate: use model kind hf, or a "
                         "Trainer program")
    if ce.base and spec.model.kind != "hf":
        raise refuse(("base",), "the base model is evaluated for model kind hf, whose folder is known; a program's base "
                                "is in its own arguments: leave base out")
    if ce.kind == "generate":
        ce.prompts = str(local_path(here, ce.prompts))
        set_path(raw, (*FIELD, "prompts"), ce.prompts)
        from train_entry.checkpoint_eval import EvalError, read_prompts  # reads the file: what the evaluations will read

        try:
            read_prompts(ce.prompts)
        except EvalError as exc:
            raise refuse(("prompts",), str(exc)) from None
    elif ce.kind == "lm-eval":
        if importlib.util.find_spec("lm_eval") is None:
            raise refuse(("kind",), "the lm-eval harness is not installed: pip install 'orchestrate[lm-eval]'")
        ce.include_path = str(local_path(here, ce.include_path))
        set_path(raw, (*FIELD, "include_path"), ce.include_path)
        named = task_names(Path(ce.include_path))
        if named is None:
            raise refuse(("include_path",), f"no folder '{ce.include_path}'")
        for i, task in enumerate(ce.tasks):
            if task not in named:
                raise refuse(("tasks", i), f"no task {task!r} in the YAMLs of {ce.include_path} "
                                           f"(they name: {', '.join(sorted(named)) or 'none'})")
    else:
        found = command_check.problems(ce.argv, str(here), spec.env.get("PATH", os.environ.get("PATH")))
        if found:
            raise SpecError([yamlsrc.issue(lines, (*FIELD, "argv", i), message.replace("model.cwd", "the spec's folder"), source)
                             for i, message in found])


def task_names(folder: Path) -> set[str] | None:
    """The `task:` names of the harness's YAMLs in ``folder`` (and below); None: no folder.
    Its own tags (`!function`) are read as plain values: nothing here runs them."""
    if not folder.is_dir():
        return None
    names: set[str] = set()
    for path in sorted(folder.rglob("*.y*ml"))[:1000]:
        try:
            doc = yaml.load(path.read_text(errors="replace")[:1_000_000], Loader=_Tolerant)
        except (yaml.YAMLError, OSError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("task"), str):
            names.add(doc["task"])
        if isinstance(doc, dict) and isinstance(doc.get("group"), str):
            names.add(doc["group"])
    return names


class _Tolerant(yaml.SafeLoader):
    pass


_Tolerant.add_multi_constructor("!", lambda loader, suffix, node: None)
