"""Batch-script injection. Every spec string that reaches the batch script or an argv
is refused by the spec when it could end its line, or read one way to sbatch's
``#SBATCH`` parser and another to bash; a value that bypasses the spec is refused by
the renderer, or rendered so that it stays inside its line. Rendered scripts run
under bash with stub ``srun``/``scontrol``/``sbatch`` first on PATH; no SLURM needed."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from conftest import write
from orchestrator.errors import SpecError, UserError
from orchestrator.scheduler.slurm_script import batch_parameters, check_parameters, render_batch_script
from orchestrator.spec.experiment import Spec
from orchestrator.scheduler import fragments
from orchestrator.spec.load import load_spec
from orchestrator.spec.templates import fragment_names
from orchestrator.submit.submission import make_plan

MARK = "PWNED"  # the file an injected command would create in the script's folder

PAYLOADS = {
    "newline": f"x\ntouch {MARK}",
    "newline-then-comment": f"x\ntouch {MARK} #",
    "carriage-return": f"x\rtouch {MARK}",
    "escaped-newline": f"x\\\ntouch {MARK}",
    "double-quote-break": f'a" ; touch {MARK} ; "',
    "single-quote-break": f"a' ; touch {MARK} ; '",
    "backslash-quote": f"a\\' ; touch {MARK} #",
    "command-substitution": f"$(touch {MARK})",
    "backticks": f"`touch {MARK}`",
    "semicolon": f"x;touch {MARK}",
    "nul": f"x\x00touch {MARK}",
    "line-separator": f"x\u2028touch {MARK}",
    "next-line": f"x\x85touch {MARK}",
    "hetjob": "a-hetjob",
}
KEY_PAYLOADS = {**PAYLOADS, "space": "mail type", "equals": "mail-type=END", "underscore": "mail_type"}

CLEAN = {
    "name": "inj",
    "steps": 1,
    "resources": {
        "nodes": 2,
        "tasks_per_node": 2,
        "partition": "gpu",
        "account": "proj42",
        "qos": "normal",
        "constraint": "a100",
        "exclude": ["n1"],
        "setup_templates": ["nccl"],
        "setup": ["true"],
        "srun_args": ["--container-image=/images/pt.sqsh"],
        "sbatch_extra": {"mail-type": "END", "exclusive": True},
    },
}


def _set_resource(field, wrap=lambda p: p):
    return lambda doc, p: doc["resources"].__setitem__(field, wrap(p))


# field -> (put the payload in a spec document, the issue path the loader must name)
SPEC_FIELDS = {
    "partition": (_set_resource("partition"), "resources.partition"),
    "account": (_set_resource("account"), "resources.account"),
    "qos": (_set_resource("qos"), "resources.qos"),
    "constraint": (_set_resource("constraint"), "resources.constraint"),
    "exclude": (_set_resource("exclude", lambda p: ["n1", p]), "resources.exclude[1]"),
    "sbatch_extra-value": (_set_resource("sbatch_extra", lambda p: {"mail-type": p}), "resources.sbatch_extra.mail-type"),
    "setup_templates": (_set_resource("setup_templates", lambda p: [p]), "resources.setup_templates[0]"),
    "workdir": (lambda doc, p: doc.__setitem__("workdir", p), "workdir"),
    "name": (lambda doc, p: doc.__setitem__("name", p), "name"),
}


def _spec_doc(put, payload) -> dict:
    doc = json.loads(json.dumps(CLEAN))
    put(doc, payload)
    return doc


def _issues(tmp_path, doc) -> list:
    spec = tmp_path / "spec.yaml"
    spec.write_text(json.dumps(doc))  # JSON is YAML, and escapes every control character
    with pytest.raises(SpecError) as err:
        load_spec(spec)
    return err.value.issues


# ------------------------------------------------------------------ (a) the spec refuses


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
@pytest.mark.parametrize("field", SPEC_FIELDS)
def test_the_spec_refuses_the_payload_naming_the_field(tmp_path, field, payload):
    put, path = SPEC_FIELDS[field]
    doc = _spec_doc(put, payload)
    issues = _issues(tmp_path, doc)
    assert path in [i.path for i in issues], [i.render() for i in issues]
    for i in issues:  # the message repeats the value escaped: one line, nothing a terminal acts on
        assert i.render().isprintable(), i.render()
    with pytest.raises(ValidationError):  # the models refuse it too, with no file or YAML layer
        Spec.model_validate(doc)


@pytest.mark.parametrize("key", KEY_PAYLOADS.values(), ids=KEY_PAYLOADS.keys())
def test_the_spec_refuses_a_bad_sbatch_extra_key(tmp_path, key):
    doc = _spec_doc(_set_resource("sbatch_extra", lambda k: {k: "1"}), key)
    issues = _issues(tmp_path, doc)
    assert any(i.path.startswith("resources.sbatch_extra") for i in issues), [i.render() for i in issues]
    for i in issues:
        assert i.message.isprintable(), i.message
    with pytest.raises(ValidationError):
        Spec.model_validate(doc)


@pytest.mark.parametrize(
    "key, instead",
    [("nodes", "resources.nodes"), ("time", "resources.time"), ("tim", "resources.time"), ("N", "resources.nodes"),
     ("signal", "checkpoint.signal"), ("requeue", "retry."), ("no-requeue", "retry."), ("array", "sweep"),
     ("output", "run folder"), ("error", "run folder"), ("job-name", "`name`"), ("ntasks", "tasks_per_node"),
     ("ntasks-per-node", "tasks_per_node"), ("gpus", "gpus_per_task"), ("mem", "resources.mem"), ("wckey", "tags")],
)
def test_options_orchestrate_sets_are_refused_with_the_field_to_use(key, instead):
    with pytest.raises(ValidationError) as err:
        Spec.model_validate(_spec_doc(_set_resource("sbatch_extra", lambda k: {k: "1"}), key))
    assert "set by orchestrate" in str(err.value) and instead in str(err.value)


def test_slurm_grammar_is_accepted_and_dashes_before_an_option_are_dropped():
    doc = _spec_doc(lambda d, _: None, None)
    doc["resources"].update(
        partition="gpu,debug", account="proj-42_x", qos="high.prio", constraint="[rack1*2&rack2*4]|(a100,h100)",
        exclude=["g[001-004,007]", "n1.cluster"], sbatch_extra={"--mail-type": "END", "mail-user": "me@example.org",
        "hint": False, "time-min": "30", "export": "ALL,A=b c #d", "dependency": "afterok:12?afterany:13"},
    )
    doc["workdir"] = "/scratch/my runs (2)/#x"
    r = Spec.model_validate(doc).resources
    assert r.sbatch_extra["mail-type"] == "END" and "--mail-type" not in r.sbatch_extra


def test_srun_args_and_setup_are_the_users_shell_but_without_nul_or_broken_arguments(tmp_path):
    ok = _spec_doc(_set_resource("srun_args", lambda p: p), ["--export=ALL,X=$(hostname)", "--container-mounts=/a:/b"])
    ok["resources"]["setup"] = ["source /opt/env/bin/activate && echo $(hostname) `date` ; true", "if true; then\n  true\nfi"]
    Spec.model_validate(ok)
    for field, value, path in (
        ("srun_args", ["--a\n--b"], "resources.srun_args[0]"),
        ("srun_args", ["--a\u2028b"], "resources.srun_args[0]"),
        ("srun_args", ["--a\x00b"], "resources.srun_args[0]"),
        ("setup", ["true", "echo \x00"], "resources.setup[1]"),
    ):
        doc = _spec_doc(_set_resource(field), value)
        assert path in [i.path for i in _issues(tmp_path, doc)]
        with pytest.raises(ValidationError):
            Spec.model_validate(doc)


# ------------------------------------------------------------------ (b) the renderer refuses or neutralises


@pytest.fixture(scope="module")
def clean_plan(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    plan = make_plan(str(write(tmp / "spec.yaml", json.dumps(CLEAN))), [], "slurm", tmp)
    return dataclasses.replace(plan, experiment_id="0123abcd", run_dir=tmp / "runs" / "inj-0123abcd")


def _with_resources(plan, **update):
    return dataclasses.replace(plan, resources=plan.resources.model_copy(update=update))


# field -> (the plan with the payload, bypassing validation; the words a refusal names;
#           the #SBATCH option(s) it changes; the argument sbatch must read, from that plan)
def _option_field(name: str):
    """A resources field that is one #SBATCH option of the same name."""
    return (lambda pl, p: _with_resources(pl, **{name: p}), f"resources.{name}", {name}, lambda pl, p: f"--{name}={p}")


RENDER_FIELDS = {
    **{name: _option_field(name) for name in ("partition", "account", "qos", "constraint")},
    "exclude": (
        lambda pl, p: _with_resources(pl, exclude=["n1", p]), "resources.exclude", {"exclude"}, lambda pl, p: f"--exclude=n1,{p}",
    ),
    "sbatch_extra-value": (
        lambda pl, p: _with_resources(pl, sbatch_extra={**pl.resources.sbatch_extra, "mail-type": p}),
        "resources.sbatch_extra", {"mail-type"}, lambda pl, p: f"--mail-type={p}",
    ),
    "sbatch_extra-key": (
        lambda pl, p: _with_resources(pl, sbatch_extra={**pl.resources.sbatch_extra, p: "1"}),
        "resources.sbatch_extra", set(), lambda pl, p: f"--{p.replace('_', '-')}=1",
    ),
    "workdir": (
        lambda pl, p: dataclasses.replace(pl, run_dir=pl.run_dir.parent / p / pl.run_dir.name),
        "workdir", {"output"}, lambda pl, p: f"--output={pl.run_dir}/submitit/%j_0_log.out",
    ),
    "name": (lambda pl, p: dataclasses.replace(pl, name=p), "name", {"job-name"}, lambda pl, p: f"--job-name={p}-0123abcd"),
    "setup_templates": (lambda pl, p: _with_resources(pl, setup_templates=[p]), "setup template", set(), None),
}


def slurm_args(line: str) -> list[str]:
    """The arguments sbatch reads from one ``#SBATCH`` line: SLURM's get_argument (quotes
    of both kinds, backslash escapes everywhere, an unquoted '#' ends the line)."""
    rest, i, args = line[len("#SBATCH"):], 0, []
    space = " \t\n\v\f\r"
    while True:
        while i < len(rest) and rest[i] in space:
            i += 1
        arg, quote, escaped = [], None, False
        while i < len(rest) and (quote or rest[i] not in space):
            ch = rest[i]
            i += 1
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
                continue
            elif quote:
                if ch == quote:
                    quote = None
                    continue
            elif ch in "'\"":
                quote = ch
                continue
            elif ch == "#":
                i = len(rest)
                break
            arg.append(ch)
        assert quote is None, f"sbatch: unmatched {quote} in {line!r}"
        if not arg:
            return args
        args.append("".join(arg))


def directive_block(script: str) -> list[str]:
    """The lines sbatch reads directives from: up to the first command (lines end at
    '\\n' only, for sbatch and bash alike)."""
    out = []
    for line in script.split("\n"):
        stripped = line.lstrip(" \t\n\v\f\r")
        if line.startswith("#SBATCH"):
            out.append(line)
        elif stripped and not stripped.startswith("#"):
            break
    return out


def _option(directive: str) -> str:
    return directive.split()[1].split("=")[0].removeprefix("--")


STUBS = ("srun", "scontrol", "sbatch", "squeue", "sacct", "scancel", "module", "python3")


def run_script(script: str, tmp: Path) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """Run the script under bash in ``tmp`` with stubs first on PATH; each stub records
    its argv (NUL-separated, so nothing in an argument can fake a record)."""
    stubs, calls = tmp / "stubs", tmp / "calls"
    stubs.mkdir(parents=True)
    calls.mkdir()
    for name in STUBS:
        stub = stubs / name
        stub.write_text('#!/bin/bash\nprintf \'%s\\0\' "${0##*/}" "$@" > "$STUB_CALLS/call.$$.$RANDOM"\n')
        stub.chmod(0o755)
    path = tmp / "job.sh"
    path.write_bytes(script.encode("utf-8", "surrogateescape"))
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_CALLS": str(calls), "HOME": str(tmp), "LC_ALL": "C.UTF-8"}
    out = subprocess.run(["bash", str(path)], cwd=tmp, env=env, capture_output=True, timeout=30)
    argvs = [f.read_bytes().decode("utf-8", "surrogateescape").split("\0")[:-1] for f in sorted(calls.iterdir())]
    return out, argvs


def _srun_argv(plan) -> list[str]:
    folder = plan.run_dir / "submitit"
    return ["srun", "--unbuffered", "--output", f"{folder}/%j_%t_log.out", "--kill-on-bad-exit=1",
            *plan.resources.srun_args, "python3", "-u", "-m", "submitit.core._submit", str(folder)]


def assert_script_is_safe(script: str, clean: str, plan, changed: set[str], expected_arg: str | None, tmp: Path) -> None:
    block, clean_block = directive_block(script), directive_block(clean)
    # every directive of a clean render is still read by sbatch, before the first command
    missing = [d for d in clean_block if _option(d) not in changed and d not in block]
    assert not missing, f"sbatch no longer reads {missing}"
    assert len(block) == len([l for l in script.split("\n") if l.startswith("#SBATCH")]), "an #SBATCH line after a command"
    for d in block:
        # sbatch and bash read each directive alike, and no line starts a het-job component
        assert slurm_args(d) == shlex.split(d[len("#SBATCH"):]), d
        assert not re.search("hetjob|packjob", d, re.I), d
    if expected_arg is not None:
        assert expected_arg in [a for d in block for a in slurm_args(d)], (expected_arg, block)
    out, argvs = run_script(script, tmp)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    assert not list(tmp.rglob(MARK)), "the payload ran a command"
    assert argvs == [_srun_argv(plan)], argvs  # only the trainer step ran, with its own arguments
    assert f"orchestrate: {plan.name} (0123abcd) job".encode() in out.stdout


def test_a_clean_render_runs_only_the_trainer_step(clean_plan, tmp_path):
    clean = render_batch_script(clean_plan, python="python3")
    assert len(directive_block(clean)) >= 15
    assert_script_is_safe(clean, clean, clean_plan, set(), "--partition=gpu", tmp_path)


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
@pytest.mark.parametrize("field", RENDER_FIELDS)
def test_the_renderer_refuses_or_neutralises_the_payload(clean_plan, tmp_path, field, payload):
    bypass, names, changed, arg = RENDER_FIELDS[field]
    plan = bypass(clean_plan, payload)
    try:
        script = render_batch_script(plan, python="python3")
    except UserError as exc:
        assert names in str(exc) and str(exc).isprintable(), str(exc)
        return
    clean = render_batch_script(clean_plan, python="python3")
    assert_script_is_safe(script, clean, plan, changed, arg and arg(plan, payload), tmp_path)


@pytest.mark.parametrize("key", KEY_PAYLOADS.values(), ids=KEY_PAYLOADS.keys())
def test_the_renderer_refuses_or_neutralises_a_bad_option_name(clean_plan, tmp_path, key):
    bypass, names, changed, arg = RENDER_FIELDS["sbatch_extra-key"]
    plan = bypass(clean_plan, key)
    try:
        script = render_batch_script(plan, python="python3")
    except UserError as exc:
        assert names in str(exc) and str(exc).isprintable(), str(exc)
        return
    assert_script_is_safe(script, render_batch_script(clean_plan, python="python3"), plan, changed, arg(plan, key), tmp_path)


def test_payloads_in_srun_args_stay_one_argument(clean_plan, tmp_path):
    args = ["--export=ALL,X=$(touch PWNED)", "`touch PWNED`", "a' ; touch PWNED ; '", 'a" ; touch PWNED ; "', "x;touch PWNED"]
    plan = _with_resources(clean_plan, srun_args=args)
    assert_script_is_safe(render_batch_script(plan, python="python3"), render_batch_script(clean_plan, python="python3"),
                          plan, set(), None, tmp_path)


@pytest.mark.parametrize("arg", ["--a\n--b", "--a\x00", "--a\u2028b"])
def test_srun_args_with_line_breaks_are_refused_by_the_renderer(clean_plan, arg):
    with pytest.raises(UserError, match="resources.srun_args"):
        render_batch_script(_with_resources(clean_plan, srun_args=[arg]), python="python3")


def test_an_edited_parameters_file_is_refused_before_a_resubmission(clean_plan):
    """resubmit reads sbatch-parameters.json back: the same last check runs on it."""
    params = json.loads(json.dumps(batch_parameters(clean_plan)))
    folder = clean_plan.run_dir / "submitit"
    assert check_parameters(params, folder) == params
    for key, value, where in (
        ("partition", "gpu\ntouch PWNED", "resources.partition"),
        ("job_name", "x'y", "name"),
        ("additional_parameters", {"mail type": "x"}, "resources.sbatch_extra"),
        ("additional_parameters", {"mail-type": "a\\"}, "resources.sbatch_extra"),
        ("srun_args", ["--a\nb"], "resources.srun_args"),
        ("setup", ["echo \x00"], "resources.setup"),
    ):
        with pytest.raises(UserError, match=re.escape(where)):
            check_parameters({**params, key: value}, folder)
    with pytest.raises(UserError, match="run folder"):
        check_parameters(params, Path("/tmp/x\ntouch PWNED/submitit"))


# ------------------------------------------------------------------ template placeholders


@pytest.fixture
def templates(tmp_path, monkeypatch):
    d = tmp_path / "templates"
    (d / "sbatch").mkdir(parents=True)
    monkeypatch.setenv("ORCHESTRATE_TEMPLATES", str(d))
    return d / "sbatch"


def test_placeholder_values_are_single_shell_words(templates, tmp_path):
    write(templates / "common.sh", "printf '[%s]\\n' {{name}} {{run_dir}}\n")
    evil = ["$(touch PWNED)", "`touch PWNED`", "a' ; touch PWNED ; '", 'a" ; touch PWNED ; "', "x;touch PWNED", "a b #c"]
    for value in evil:
        lines = fragments.render("common", {"name": value, "run_dir": "/r/my runs"})
        out, argvs = run_script("\n".join(lines) + "\n", Path(tmp_path / f"run{evil.index(value)}").resolve())
        assert out.stdout.decode() == f"[{value}]\n[/r/my runs]\n" and argvs == []
    assert not list(tmp_path.rglob(MARK))


@pytest.mark.parametrize("payload", [p for k, p in PAYLOADS.items() if any(c in p for c in "\n\r\x00\u2028\x85")])
def test_placeholder_values_with_control_characters_are_refused(templates, payload):
    write(templates / "common.sh", "echo {{name}}\n")
    with pytest.raises(UserError, match=r"\{\{name\}\}") as err:
        fragments.render("common", {"name": payload})
    assert str(err.value).isprintable()


@pytest.mark.parametrize(
    "line", ['echo "hello {{name}}"', "echo 'hello {{name}}'", 'echo "$(echo {{name}})"', 'x="a\\"{{name}}"']
)
def test_a_placeholder_inside_quotes_is_a_template_error(templates, line):
    write(templates / "common.sh", f"# a comment's quote does not count: {{{{name}}}}\n{line}\n")
    with pytest.raises(UserError, match=r"common\.sh:2: \{\{name\}\} is inside"):
        fragments.render("common", {"name": "x"})


def test_a_placeholder_inside_a_here_document_is_a_template_error(templates):
    write(templates / "common.sh", "cat <<EOF\nrun {{name}}\nEOF\n")
    with pytest.raises(UserError, match="here-document"):
        fragments.render("common", {"name": "x"})
    write(templates / "common.sh", "cat <<< {{name}}\n")  # a here-string is a word
    assert fragments.render("common", {"name": "x y"})[1] == "cat <<< 'x y'"


def test_a_template_name_is_never_a_path(templates):
    write(templates.parent / "evil.sh", "touch PWNED\n")
    with pytest.raises(UserError, match="not a file name"):
        fragments.render("../evil", {})


def test_the_shipped_templates_render_and_run(tmp_path, monkeypatch):
    monkeypatch.delenv("ORCHESTRATE_TEMPLATES", raising=False)
    values = {"name": "n", "experiment_id": "0123abcd", "run_dir": "/scratch/my runs/n-0123abcd"}
    lines = [l for name in ["common", *fragment_names()] for l in fragments.render(name, values)]
    out, argvs = run_script("\n".join(lines) + "\nprintf '%s\\n' \"$ORCHESTRATE_RUN_DIR\"\n", tmp_path)
    assert out.returncode == 0 and argvs == [], out.stderr
    assert out.stdout.decode().startswith("orchestrate: n (0123abcd) job ")
    assert out.stdout.decode().endswith("/scratch/my runs/n-0123abcd\n")
