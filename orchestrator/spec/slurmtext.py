"""Spec text that ends up in the batch script or in an argv: the checks, and the
pydantic types that apply them when a spec is loaded.

The batch script is read twice: by sbatch, for its ``#SBATCH`` lines, and by bash. A
value must mean the same to both, so:

- no control characters: a line break (``\\n``, ``\\r``, U+2028 ...) ends the
  ``#SBATCH`` comment and bash runs what follows, while sbatch stops reading
  directives at that line and silently drops every option after it;
- in an ``#SBATCH`` value, no quotes or backslashes: SLURM honours ``\\`` escapes
  inside quotes and bash does not, so the two disagree on where a quoted value ends;
- no ``hetjob``/``packjob`` in a directive: sbatch takes such a line as the start of
  another heterogeneous-job component, whatever option it is in.

Where SLURM has a grammar (partition, account and QOS names, feature expressions,
host lists) the value must follow it. The same checks run again where the script is
written (``orchestrator.scheduler.slurm``, ``orchestrator.scheduler.fragments``), for
values that never went through a spec.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated, Callable

from pydantic import AfterValidator

from orchestrator.spec.strict import FieldError

SHOW = 60  # characters of a bad value an error message repeats

# control (C0, DEL, C1 with NEL), invisible formatting (bidi overrides), surrogates,
# line and paragraph separators
_BAD_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_NAMED = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL byte"}
_LINE_BREAKS = frozenset("\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029")  # what str.splitlines splits on
_DIRECTIVE_UNSAFE = frozenset("'\"\\")
_SHELL_SYNTAX = frozenset("$`;")  # quoted, they are inert; in a spec they are a mistake
_HETJOB = re.compile(r"hetjob|packjob", re.IGNORECASE)

NAME_CHARS = "letters, digits, '_', '.', '-'"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_NAME_LIST = re.compile(r"[A-Za-z0-9_.\-]+(,[A-Za-z0-9_.\-]+)*")
_FEATURES = re.compile(r"[A-Za-z0-9_.\-&|,*\[\]()!:]+")
_HOSTLIST = re.compile(r"[A-Za-z0-9_.\-,\[\]]+")
OPTION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9-]*")
TEMPLATE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")

# sbatch options orchestrate writes itself (or that contradict what it writes), and the
# spec field to use instead; getopt_long also takes any unambiguous abbreviation of them
OWNED_OPTIONS = {
    "nodes": "set resources.nodes",
    "ntasks": "set resources.nodes and resources.tasks_per_node (one node agent runs per node)",
    "ntasks-per-node": "set resources.tasks_per_node (one node agent runs per node and starts the ranks)",
    "cpus-per-task": "set resources.cpus_per_task",
    "gpus": "set resources.gpus_per_task",
    "gpus-per-node": "set resources.gpus_per_task",
    "gpus-per-task": "set resources.gpus_per_task",
    "mem": "set resources.mem",
    "time": "set resources.time",
    "partition": "set resources.partition",
    "account": "set resources.account",
    "qos": "set resources.qos",
    "constraint": "set resources.constraint",
    "exclude": "set resources.exclude",
    "job-name": "the job name comes from the spec's `name`",
    "array": "the array comes from `sweep` (sweep.max_parallel throttles it)",
    "output": "orchestrate reads each task's log from the run folder",
    "error": "orchestrate reads each task's log from the run folder",
    "open-mode": "orchestrate reads each task's log from the run folder",
    "signal": "set checkpoint.signal and checkpoint.signal_before_s",
    "requeue": "orchestrate requeues by itself (retry.max_requeues, retry.max_recoveries)",
    "no-requeue": "orchestrate requeues by itself (retry.max_requeues, retry.max_recoveries)",
    "comment": "orchestrate tags its jobs with it",
    "wckey": "orchestrate tags its jobs with it",
    "wrap": "orchestrate writes the batch script",
}
_SHORT = {"N": "nodes", "n": "ntasks", "c": "cpus-per-task", "G": "gpus", "t": "time", "p": "partition",
          "A": "account", "q": "qos", "C": "constraint", "x": "exclude", "J": "job-name", "a": "array",
          "o": "output", "e": "error"}


# ------------------------------------------------------------------ messages


def shown(value: object) -> str:
    """At most SHOW characters of a value, quoted, control characters escaped as repr does."""
    text = str(value)
    return repr(text[:SHOW]) + ("..." if len(text) > SHOW else "")


def _describe(ch: str) -> str:
    name = unicodedata.name(ch, "").lower() or "a control character"
    return _NAMED.get(ch) or f"U+{ord(ch):04X} ({name})"


# ------------------------------------------------------------------ checks (raise ValueError)


def first_control(text: str) -> int | None:
    """Index of the first control, invisible-format or line-separator character."""
    for i, ch in enumerate(text):
        if unicodedata.category(ch) in _BAD_CATEGORIES:
            return i
    return None


def no_control(text: str) -> str:
    if (i := first_control(text)) is not None:
        raise ValueError(
            f"{shown(text)} contains {_describe(text[i])} at position {i}; "
            "control characters and line breaks are not allowed here"
        )
    return text


def no_nul(text: str) -> str:
    if (i := text.find("\x00")) >= 0:
        raise ValueError(f"{shown(text)} contains a NUL byte at position {i}; the shell cannot hold one")
    return text


def argv_element(text: str) -> str:
    """One argument of a command: anything but NUL and line breaks (never intended in one)."""
    no_nul(text)
    for i, ch in enumerate(text):
        if ch in _LINE_BREAKS:
            raise ValueError(f"{shown(text)} contains {_describe(ch)} at position {i}; one argument is one line")
    return text


def directive_text(text: str) -> str:
    """A value sbatch reads from an ``#SBATCH`` line: no control characters, quotes or
    backslashes, and not the het-job separator words."""
    no_control(text)
    for i, ch in enumerate(text):
        if ch in _DIRECTIVE_UNSAFE:
            raise ValueError(
                f"{shown(text)} contains {ch!r} at position {i}; quotes and backslashes are not allowed "
                "in an #SBATCH value (SLURM and bash would read it differently)"
            )
    if m := _HETJOB.search(text):
        raise ValueError(f"{shown(text)} contains '{m.group(0)}', which sbatch takes as a heterogeneous-job separator")
    return text


def _grammar(pattern: re.Pattern, what: str, allowed: str) -> Callable[[str], str]:
    def check(text: str) -> str:
        no_control(text)
        if not pattern.fullmatch(text):
            raise ValueError(f"{shown(text)} is not {what}: use {allowed}")
        return directive_text(text)

    return check


slurm_name = _grammar(_NAME, "a SLURM name", NAME_CHARS)
partition_list = _grammar(_NAME_LIST, "a SLURM partition list", f"{NAME_CHARS}; several partitions comma-separated")
feature_expression = _grammar(
    _FEATURES, "a SLURM feature expression", f"{NAME_CHARS} and the operators & | , * [ ] ( ) ! :"
)
node_names = _grammar(_HOSTLIST, "a SLURM node name or host list", f"{NAME_CHARS}, ',' and brackets (g[001-004])")
template_name = _grammar(TEMPLATE_NAME, "a setup template name", f"{NAME_CHARS} (the file's name without .sh)")


def no_shell_syntax(text: str) -> str:
    """The value is written quoted, so ``$``, backticks and ``;`` would stay literal text:
    neither sbatch nor orchestrate expands variables or runs commands in it."""
    for i, ch in enumerate(text):
        if ch in _SHELL_SYNTAX:
            raise ValueError(
                f"{shown(text)} contains {ch!r} at position {i}; variables and commands are not expanded "
                "here, so write the value itself"
            )
    return text


def path_text(text: str) -> str:
    """A folder that reaches ``#SBATCH --output``: as a directive value, and no '%'
    (SLURM expands %-patterns in log file names)."""
    directive_text(text)
    if "%" in text:
        raise ValueError(f"{shown(text)} contains '%', which SLURM expands in log file names")
    return text


def mount_text(text: str) -> str:
    """One bind mount, ``src[:dst[:options]]``: one argument, and no ',' (Apptainer's --bind and
    pyxis's --container-mounts separate mounts with it)."""
    argv_element(no_control(text))
    if "," in text:
        raise ValueError(f"{shown(text)} contains ','; give each mount as its own list item")
    if not text.startswith("/"):
        raise ValueError(f"{shown(text)} is not an absolute path; write `/host/path[:/container/path]`")
    return text


def workdir_text(text: str) -> str:
    return no_shell_syntax(path_text(text))


def option_name(key: str) -> str:
    """An sbatch option for ``sbatch_extra``, without its dashes; not one orchestrate owns."""
    bare = key[2:] if key.startswith("--") else key
    if first_control(bare) is not None or not OPTION_NAME.fullmatch(bare):
        raise ValueError(
            f"option {shown(key)} is not an sbatch option name: use letters, digits and '-', starting "
            "with a letter, without '=' (the value goes after the colon), e.g. `mail-type: END`"
        )
    directive_text(bare)
    long = _SHORT.get(bare, bare)
    for owned, instead in OWNED_OPTIONS.items():
        if owned.startswith(long):  # exact, or an abbreviation sbatch would expand to it
            raise ValueError(f"option '{bare}' (sbatch's --{owned}) is set by orchestrate: {instead}")
    return bare


def option_value(value: str | int | bool) -> str | int | bool:
    if isinstance(value, str):
        no_shell_syntax(directive_text(value))
    return value


# ------------------------------------------------------------------ collections (errors name the item)


def _each(check: Callable[[str], str]) -> Callable[[list[str]], list[str]]:
    def run(items: list[str]) -> list[str]:
        for i, item in enumerate(items):
            try:
                check(item)
            except ValueError as exc:
                raise FieldError((i,), str(exc)) from None
        return items

    return run


def _optional(check: Callable[[str], str]) -> Callable[[str | None], str | None]:
    return lambda v: v if v is None else check(v)


def sbatch_extra(options: dict[str, str | int | bool]) -> dict[str, str | int | bool]:
    """Check every option name and value; names come back without leading dashes."""
    out = {}
    for key, value in options.items():
        try:
            bare = option_name(key)
        except ValueError as exc:  # the key itself is not safe to print as a path
            raise FieldError((), str(exc)) from None
        if bare in out:
            raise FieldError((), f"option '{bare}' is given twice")
        try:
            out[bare] = option_value(value)
        except ValueError as exc:
            raise FieldError((key,), str(exc)) from None
    return out


# ------------------------------------------------------------------ the types the spec uses

# Each wraps the whole field type, so the field's annotation (and the docs' spec
# reference generated from it) stays the plain type.
OptionalPartition = Annotated[str | None, AfterValidator(_optional(partition_list))]
OptionalSlurmName = Annotated[str | None, AfterValidator(_optional(slurm_name))]
OptionalConstraint = Annotated[str | None, AfterValidator(_optional(feature_expression))]
OptionalPath = Annotated[str | None, AfterValidator(_optional(workdir_text))]
NodeNames = Annotated[list[str], AfterValidator(_each(node_names))]
TemplateNames = Annotated[list[str], AfterValidator(_each(template_name))]
ShellLines = Annotated[list[str], AfterValidator(_each(no_nul))]  # the user's own shell: trusted
ArgvList = Annotated[list[str], AfterValidator(_each(argv_element))]
Mounts = Annotated[list[str], AfterValidator(_each(mount_text))]
ArgvText = Annotated[str, AfterValidator(lambda v: argv_element(no_control(v)))]
SbatchExtra = Annotated[dict[str, str | int | bool], AfterValidator(sbatch_extra)]
