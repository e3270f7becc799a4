"""Checks on the login node before anything is queued (``submit``, ``submit --dry-run``,
``validate`` and ``plan`` all make their plan through ``submission.make_plan``, which
calls ``check``): what would otherwise fail minutes later on a compute node, after the
queue wait.

For ``model: {kind: hf}``: the folder has ``config.json`` and weights (or the named GGUF
file), tokenizer files and a chat template; transformers can build the model from its
config (on the meta device: no weights are read) with the spec's attention kernel; each
LoRA/QLoRA target module is a linear layer of it; ``data.max_length`` fits its positions.
For records (``data: {kind: jsonl | parquet | arrow}``): ``path`` and ``eval_path`` exist
and every line or row is a valid record (streamed, the same reader the trainer's
preparation uses; inputs whose content is prepared in the data cache already were checked
then, and are not read again), and
``eval_fraction`` leaves at least one record on each side.

Every problem found is reported at once, each with the spec file, line and field (and
the data file and line), as one UserError. Where transformers is not importable the
model checks that need it are skipped with a warning (the compute nodes still fail
clearly). A spec with neither kind costs nothing here: no import, no file read.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from orchestrator.contract import chatdata, datacache
from orchestrator.errors import SpecError, SpecIssue
from orchestrator.spec import shown, yamlsrc
from orchestrator.spec.hf import RECORD_KINDS
from orchestrator.submit import command_check

log = logging.getLogger(__name__)

Field = tuple  # a spec field path: ("model", "lora", "target_modules", 0)
Problem = tuple[Field, str]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
WEIGHT_GLOBS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")
SAVE_HINT = "a folder written by save_pretrained (model and tokenizer)"


class PreflightError(SpecError):
    """Every problem the login node found in what the spec points at."""

    def __init__(self, issues: list[SpecIssue]):
        super().__init__(issues)
        n = len(self.issues)
        head = f"{n} problem{'s' if n != 1 else ''} found before queueing anything (nothing was submitted)"
        self.args = (head + "\n" + "\n".join("  " + i.render() for i in self.issues),)


def check(plan, lines: dict, source: str, model_files: bool = True, data: bool = True) -> list[str]:
    """Raise PreflightError listing every problem of every task's model and data; return
    what was not checked. ``model_files=False``: a model folder's weights and tokenizer
    may be absent (planning from config.json alone); ``data=False``: no data file is read."""
    checker = _Checker()
    problems: list[Problem] = []
    skipped: dict[str, None] = {}
    for task in plan.tasks:
        spec = task.spec or plan.spec
        if spec.model.kind == "hf":
            found, for_training = checker.model(spec.model, spec.data)
            problems += found
            if model_files:
                problems += for_training
            else:
                skipped.update(dict.fromkeys(f"{message} (submit checks it)" for _, message in for_training))
        if spec.model.kind == "command":
            skipped[command_check.NOT_CHECKED] = None
        if spec.data.kind in RECORD_KINDS:
            if data:
                problems += checker.data(spec.data)
            else:
                skipped[f"the records of {_named(spec.data.paths)} (plan reads no data; validate and submit check every line)"] = None
    seen, issues = set(), []
    for field, message in problems:  # a sweep repeats the same problem in every task
        if (field, message) not in seen:
            seen.add((field, message))
            issues.append(SpecIssue(shown.dotted(field), yamlsrc.line_of(lines, field), message, source))
    if issues:
        raise PreflightError(issues)
    return list(skipped)


class _Checker:
    """One plan's checks, each model folder and data file looked at once across a sweep."""

    def __init__(self):
        self._folders: dict = {}
        self._models: dict = {}
        self._records: dict = {}
        self._warned = False

    # ------------------------------------------------------------ model

    def model(self, m, data) -> tuple[list[Problem], list[Problem]]:
        """(problems, problems of what only training needs: weights, tokenizer, chat template)."""
        key = (m.path, m.gguf_file)
        if key not in self._folders:
            self._folders[key] = folder_problems(m.path, m.gguf_file)
        problems, for_training = (list(p) for p in self._folders[key])
        if problems:
            return problems, []  # transformers would only say the same less clearly
        built = self._meta(m)
        if built is None:
            return problems, for_training
        outline, shape, error = built
        if error:
            return [(("model", "path"), f"'{m.path}': {error}")], for_training
        adapter = m.adapter
        if adapter is not None:
            field = ("model", "qlora" if m.qlora is not None else "lora", "target_modules")
            from orchestrator.submit import hf_shape

            bad = hf_shape.target_problems(outline, adapter.target_modules)
            if bad:
                names = hf_shape.leaf_names(shape.linear)
                have = ", ".join(names) if names else "none"
                for i, what in bad:
                    problems.append((field + (i,), f"{what}; the linear layers it has: {have} (a name matches a module "
                                                   "path's last parts, e.g. q_proj or self_attn.q_proj)"))
        if data.kind in RECORD_KINDS and shape.max_positions and data.max_length > shape.max_positions:
            problems.append((("data", "max_length"), f"{data.max_length} tokens is more than the model's "
                             f"{shape.max_positions} positions (config.json); lower data.max_length"))
        return problems, for_training

    def _meta(self, m):
        """(the model's outline, its shape, error text) or None where transformers is not
        importable. The outline of a config checked before comes from the user's cache: no
        torch, no transformers imported (``outlines``)."""
        from orchestrator.submit import hf_shape, outlines

        key = (m.path, m.gguf_file, m.attn_implementation)
        if key not in self._models:
            kept = outlines.key(m.path, m.gguf_file, m.attn_implementation)
            found = outlines.read(kept) if kept else None
            if found is not None:
                try:
                    self._models[key] = (found, hf_shape.shape_of_outline(found), None)
                    return self._models[key]
                except (TypeError, ValueError, KeyError):
                    pass  # not an outline this version wrote: built again below, and kept
            try:
                outline = hf_shape.outline_of(hf_shape.meta_model(m.path, m.gguf_file, m.attn_implementation))
                if kept:
                    outlines.write(kept, outline)
                self._models[key] = (outline, hf_shape.shape_of_outline(outline), None)
            except hf_shape.Unavailable as exc:
                if not self._warned:
                    log.warning("%s on this node: model.path's config and LoRA target modules are not checked "
                                "before queueing (the compute nodes still check them)", exc)
                    self._warned = True
                self._models[key] = None
            except hf_shape.ModelError as exc:
                self._models[key] = (None, None, str(exc))
        return self._models[key]

    # ------------------------------------------------------------ data

    def data(self, d) -> list[Problem]:
        problems = []
        n = self._count(d, "path", problems)
        if d.eval_path:
            m = self._count(d, "eval_path", problems)
            if m == 0:
                problems.append((("data", "eval_path"), f"no records in {_named(d.eval_paths)}: nothing to evaluate on"))
        if n == 0:
            problems.append((("data", "path"), f"no records in {_named(d.paths)}: nothing to train on"))
        elif n is not None and d.eval_fraction:
            k = chatdata.held_out_count(n, d.eval_fraction)
            if k < 1 or n - k < 1:
                problems.append((("data", "eval_fraction"), f"{d.eval_fraction} of {n} record(s) in {_named(d.paths)} holds "
                                 f"out {k} and leaves {n - k} to train on: each side needs at least one record; give more "
                                 "records, another fraction, or data.eval_path"))
        return problems

    def _count(self, d, key: str, problems: list) -> int | None:
        """Valid records of data.path or data.eval_path (all its inputs), or None after adding
        each input's problem."""
        value = getattr(d, key)
        paths = [value] if isinstance(value, str) else list(value)
        known = prepared_count(paths, d.format, d.kind, d.cache_dir) if d.cache_dir else None
        if known is not None:
            return known
        total: int | None = 0
        for path in paths:
            if (path, d.format, d.kind) not in self._records:
                self._records[(path, d.format, d.kind)] = count_records(path, d.format, d.kind)
            n, problem = self._records[(path, d.format, d.kind)]
            if problem:  # the field, not a list item: a glob's matches are not items of the spec (the message names the file)
                problems.append((("data", key), problem))
                total = None
            elif total is not None:
                total += n
        return total


def _named(paths: list[str]) -> str:
    return f"'{paths[0]}'" + (f" and {len(paths) - 1} more" if len(paths) > 1 else "")


def prepared_count(paths: list[str], fmt: str, kind: str, cache_dir: str) -> int | None:
    """The records of inputs whose content was prepared already (every record was checked
    then): their digests remembered for these very files, an entry of that content, kind
    and format. None when not known: the inputs are read record by record."""
    from train_entry.dataprep import sources

    digests = [sources.known_digest(p, cache_dir, kind) for p in paths]
    if None in digests:
        return None
    for entry in datacache.entries(cache_dir):
        man = entry.get("manifest") or {}
        inputs = man.get("inputs") or []
        records = (man.get("counts") or {}).get("records")
        if [i.get("digest") for i in inputs if isinstance(i, dict)] == digests and man.get("format_of_records") == fmt \
                and man.get("kind_of_inputs", "jsonl") == kind and isinstance(records, int) and records >= 0:
            return records
    return None


def count_records(path: str, fmt: str, kind: str = "jsonl") -> tuple[int | None, str | None]:
    """(records, None), or (None, what is wrong: the file and line or row)."""
    from train_entry.dataprep import sources
    from train_entry.errors import UserCodeError

    p = Path(path)
    if not p.exists():
        return None, f"no {'folder' if kind == 'arrow' else 'file'} '{p}' (a relative path is taken from the spec's folder)"
    try:
        return sources.count(path, kind, fmt), None
    except chatdata.RecordError as exc:
        text = str(exc)
        if ": not JSON (" in text and kind == "jsonl":
            text += "; each non-blank line must be one JSON object"
        return None, text + ("; fix or remove that line" if kind == "jsonl" else "; fix or remove that row")
    except UserCodeError as exc:
        return None, str(exc)
    except OSError as exc:
        return None, f"'{p}': cannot read: {exc.strerror or exc}"


def folder_problems(path: str, gguf_file: str | None) -> tuple[list[Problem], list[Problem]]:
    """What the model folder lacks, by looking at its files only (no transformers): (what
    even a plan needs: the folder and its config; what only training needs: weights,
    tokenizer, chat template)."""
    folder, field = Path(path), ("model", "path")
    if not folder.exists():
        return [(field, f"no folder '{folder}'; give {SAVE_HINT} (a relative path is taken from the spec's folder)")], []
    if not folder.is_dir():
        return [(field, f"'{folder}' is a file, not a folder; give {SAVE_HINT}"
                 + ("" if folder.suffix != ".gguf" else f", or its folder with model.gguf_file: {folder.name}"))], []
    try:
        names = {p.name for p in folder.iterdir()}
    except OSError as exc:
        return [(field, f"cannot list '{folder}': {exc.strerror or exc}")], []
    if gguf_file:
        if gguf_file not in names:
            there = sorted(n for n in names if n.endswith(".gguf"))
            return [(("model", "gguf_file"), f"no file '{gguf_file}' in '{folder}'"
                     + (f"; the GGUF files there: {', '.join(there)}" if there else "; there is no .gguf file there"))], []
        return [], []  # config, weights, tokenizer and chat template all come from the GGUF file
    problems: list[Problem] = []
    if "config.json" not in names:
        gguf = sorted(n for n in names if n.endswith(".gguf"))
        hint = f"; to load a GGUF file set model.gguf_file (here: {', '.join(gguf)})" if gguf else ""
        return [(field, f"'{folder}' has no config.json: not a Hugging Face model folder; give {SAVE_HINT}{hint}")], []
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return [(field, f"'{folder / 'config.json'}' is not readable JSON ({exc})")], []
    if not any(next(folder.glob(g), None) for g in WEIGHT_GLOBS):
        problems.append((field, f"'{folder}' has config.json but no weights (*.safetensors or pytorch_model*.bin); "
                         "save the model with save_pretrained"))
    if not any(n in names for n in TOKENIZER_FILES):
        problems.append((field, f"'{folder}' has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); save the "
                         "tokenizer into it with tokenizer.save_pretrained"))
    elif not has_chat_template(folder, names):
        problems.append((field, f"the tokenizer in '{folder}' has no chat template (records are rendered with it): add "
                         "'chat_template' to tokenizer_config.json or a chat_template.jinja file"))
    return [], problems


def has_chat_template(folder: Path, names: set[str]) -> bool:
    if "chat_template.jinja" in names or "chat_template.json" in names:
        return True
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return bool(isinstance(cfg, dict) and cfg.get("chat_template"))
