"""The documentation: the site builds with no warning (broken links and anchors, pages
left out of the navigation are errors), and every command the README and the pages show
is one that works: `orchestrate ...` lines parse with the command's own parser, every
`configs/*.yaml` they name exists and validates, every `make` target, script, module and
file they run exists.

Commands are taken from the fenced ```sh blocks; every fenced block says its language, so
none is skipped by accident. Commands of other programs (SLURM's own, the shell's) are
listed in EXTERNAL and not checked."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import CHILD_TIMEOUT_S, REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LANGUAGES = {"sh", "yaml", "python", "json", "text"}
EXTERNAL = {"sinfo", "sbatch"}  # SLURM's own commands, shown on the local cluster
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.M | re.S)


def _blocks(lang: str | None = None) -> list[tuple[Path, str, str]]:
    out = []
    for page in PAGES:
        for m in FENCE.finditer(page.read_text()):
            if lang is None or m.group(1) == lang:
                out.append((page, m.group(1), m.group(2)))
    return out


def _commands() -> list[tuple[Path, list[str]]]:
    """Every command line of the ```sh blocks, as argv (comments dropped)."""
    out = []
    for page, _, body in _blocks("sh"):
        for line in body.splitlines():
            inner = re.fullmatch(r'eval "\$\((.*)\)"(\s+#.*)?', line.strip())  # eval "$(scripts/slurm-local env)"
            argv = shlex.split(inner.group(1) if inner else line, comments=True)
            if argv:
                out.append((page, argv))
    return out


def _where(page: Path, argv: list[str]) -> str:
    return f"{page.relative_to(REPO)}: {shlex.join(argv)}"


def _orchestrate_argv(argv: list[str]) -> list[str] | None:
    if argv[0] == "orchestrate":
        return argv[1:]
    if argv[:3] in (["python", "-m", "orchestrator"], ["python3", "-m", "orchestrator"]):
        return argv[3:]
    return None


def test_every_fenced_block_says_its_language():
    for page, lang, body in _blocks():
        assert lang in LANGUAGES, f"{page.relative_to(REPO)}: a ``` block without a known language: {body[:80]!r}"


def test_the_site_builds_without_a_warning(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        if os.environ.get("CI"):
            pytest.fail("mkdocs is not installed (the docs extra; make install installs it)")
        pytest.skip("mkdocs is not installed (pip install '.[docs]')")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=REPO,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARNING" not in out.stderr, out.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "spec.html").is_file()


def test_every_command_shown_is_one_we_have():
    """The first word of every command is ours and exists, or a program listed as external."""
    seen = set()
    for page, argv in _commands():
        word = argv[0]
        seen.add(word)
        if _orchestrate_argv(argv) is not None or word == "make" or word in EXTERNAL:
            continue
        if word.startswith("scripts/"):
            script = REPO / word
            assert script.is_file() and os.access(script, os.X_OK), _where(page, argv)
            if word == "scripts/slurm-local":
                assert f'cmd == "{argv[1]}"' in script.read_text(), f"no such subcommand: {_where(page, argv)}"
            continue
        assert word in ("python", "python3"), f"a command the tests do not know: {_where(page, argv)}"
        if argv[1] == "-m":
            assert importlib.util.find_spec(argv[2]) is not None, f"no module: {_where(page, argv)}"
        else:
            assert (REPO / argv[1]).is_file(), f"no file: {_where(page, argv)}"
    assert {"orchestrate", "make", "scripts/slurm-local", "python"} <= seen, seen


def test_every_orchestrate_command_parses():
    from orchestrator.cli.parser import build_parser

    parser = build_parser()
    found = 0
    for page, argv in _commands():
        args = _orchestrate_argv(argv)
        if args is None:
            continue
        found += 1
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                parser.parse_args(args)
        except SystemExit as exc:
            pytest.fail(f"does not parse ({exc.code}): {_where(page, argv)}\n{err.getvalue()}")
    assert found >= 20, found  # the extraction still finds the commands


def test_every_make_target_named_exists():
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), re.M))
    named = {argv[1] for _, argv in _commands() if argv[0] == "make"}
    for page in PAGES:  # in prose too: `make docs`
        named |= set(re.findall(r"`make ([\w-]+)`", page.read_text()))
    assert {"quickstart", "smoke", "test", "docs"} <= named, named
    assert named <= targets, f"not in the Makefile: {sorted(named - targets)}"


def _configs_named() -> dict[str, list[str]]:
    """Every configs/*.yaml the pages name, with the --set items of the commands that run it."""
    out: dict[str, list[str]] = {}
    for page in PAGES:
        for name in re.findall(r"\bconfigs/[\w.-]+\.yaml\b", page.read_text()):
            out.setdefault(name, [])
    for _, argv in _commands():
        args = _orchestrate_argv(argv) or []
        for i, word in enumerate(args):
            if word.startswith("configs/") and word.endswith(".yaml"):
                out[word] += [args[j + 1] for j in range(len(args) - 1) if args[j] == "--set"]
    return out


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """A tiny model folder and chat records for the specs whose model and data the user
    makes first (the SmolLM2 examples): what their paths would hold, so that validate
    checks everything else of them as it would on the user's machine."""
    sys.path.insert(0, str(REPO / "tests" / "hf"))
    try:
        import tiny
    finally:
        sys.path.pop(0)
    where = tmp_path_factory.mktemp("stand-ins")
    return {"model": tiny.make_model(where / "model"), "data": tiny.make_chat_data(where / "train.jsonl", n=32)}


def test_every_config_named_exists_and_validates(tmp_path, request):
    from orchestrator.cli.main import main

    configs = _configs_named()
    assert "configs/smoke.yaml" in configs and "configs/smollm2-lora-chat.yaml" in configs, sorted(configs)
    for name, overrides in sorted(configs.items()):
        path = REPO / name
        assert path.is_file(), f"the docs name {name}, which does not exist"
        extra = []
        spec = yaml.safe_load(path.read_text())
        model, data = spec.get("model") or {}, spec.get("data") or {}
        missing_model = model.get("kind") == "hf" and not Path(os.path.expanduser(model["path"])).exists()
        missing_data = data.get("kind") == "jsonl" and not Path(os.path.expanduser(data["path"])).exists()
        prompts = ((spec.get("eval") or {}).get("checkpoints") or {}).get("prompts")
        missing_prompts = prompts is not None and not Path(os.path.expanduser(prompts)).exists()
        if missing_model or missing_data or missing_prompts:
            if importlib.util.find_spec("transformers") is None and not os.environ.get("CI"):
                continue  # the hf extra is not installed: these are checked where it is
            made = request.getfixturevalue("stand_ins")
            extra += ["--set", f"model.path={made['model']}"] if missing_model else []
            extra += ["--set", f"data.path={made['data']}"] if missing_data else []
            extra += ["--set", f"eval.checkpoints.prompts={made['data']}"] if missing_prompts else []
        cwd = model.get("cwd")  # a command's working folder: made by the set-up the config's comments give
        if model.get("kind") == "command" and cwd:
            # (the tool's own config the comments copy there: configs/axolotl-smollm2-lora.yml)
            copied = [a for a in model["argv"][1:] if "/" not in a and (REPO / "configs" / a).is_file()]
            made = copied + [model["argv"][0]] if "/" in model["argv"][0] else copied  # (a tool's environment)
            real = Path(os.path.expanduser(cwd))
            if not all((real / a).is_file() for a in made):
                stand_in = tmp_path / f"cwd-{path.stem}"
                for a in made:
                    (stand_in / a).parent.mkdir(parents=True, exist_ok=True)
                    if a in copied:
                        shutil.copy(REPO / "configs" / a, stand_in / a)
                    else:
                        (stand_in / a).write_text("#!/bin/sh\n")
                        (stand_in / a).chmod(0o755)
                stand_in.mkdir(exist_ok=True)
                extra += ["--set", f"model.cwd={stand_in}"]
        argv = ["--home", str(tmp_path / "home"), "validate", str(path), *extra]
        for item in overrides:
            argv += ["--set", item]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
        assert code == 0, f"orchestrate validate {name} {' '.join(extra)}: {err.getvalue()}"


def test_the_readme_links_to_files_that_exist():
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if "://" not in link:
            assert (REPO / link).exists(), f"README.md links to {link}, which does not exist"
