"""Property-based fuzzing of the spec loader: whatever the text and the `--set` items,
loading either gives a Spec or raises SpecError (never another exception), quickly; and
the real CLI exits non-zero without a traceback on the nastiest inputs.

Deterministic (derandomized, no example database) so that the fast tier never flakes;
ORCHESTRATE_FUZZ_EXAMPLES=5000 explores further with fresh random inputs.
"""

from __future__ import annotations

import atexit
import copy
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import REPO, cli, write  # noqa: E402
from orchestrator.errors import SpecError  # noqa: E402
from orchestrator.spec import yamlsrc  # noqa: E402
from orchestrator.spec.experiment import Spec  # noqa: E402
from orchestrator.spec.load import load_spec  # noqa: E402
from orchestrator.spec.sweep import expand  # noqa: E402

EXAMPLES = int(os.environ.get("ORCHESTRATE_FUZZ_EXAMPLES", "0"))
FUZZ = settings(
    max_examples=EXAMPLES or 200,
    deadline=None,
    derandomize=not EXAMPLES,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
SECONDS = 60  # per load: a guard against a hang or a blow-up (an alias bomb expanded), not a speed
# figure: every bound makes a refusal far faster, but a loaded CI machine must not fail it

CONFIGS = {p.name: p.read_text() for p in sorted((REPO / "configs").glob("*.yaml"))}
BASES = [yaml.safe_load(text) for text in CONFIGS.values()]
WORK = Path(tempfile.mkdtemp(prefix="fuzz-spec-"))  # one file, rewritten per example (hypothesis and tmp_path do not mix)
atexit.register(shutil.rmtree, WORK, True)

# field paths of the schema, so that mutations hit real fields as often as made-up ones
SECTIONS = {
    "resources": ("nodes", "tasks_per_node", "cpus_per_task", "gpus_per_task", "mem", "gpu_memory", "time"),
    "optimizer": ("lr", "weight_decay", "betas", "momentum", "grad_clip", "name"),
    "schedule": ("warmup_steps", "min_lr_ratio", "name"),
    "batch": ("micro_batch_size", "grad_accum", "global_batch_size"),
    "checkpoint": ("every_steps", "every_minutes", "keep_last", "signal_before_s", "resume_from", "consolidate"),
    "retry": ("max_restarts", "max_recoveries", "max_requeues", "backoff_s", "backoff_max_s"),
    "heartbeat": ("interval_s", "timeout_s", "startup_timeout_s", "save_timeout_s"),
    "logging": ("every_steps",),
    "eval": ("every_steps", "max_batches"),
    "model": ("kind", "n_layer", "n_head", "d_model", "seq_len", "dropout", "path", "script", "kwargs", "lora"),
    "data": ("kind", "vocab_size", "branching", "num_tokens", "seed", "path", "max_length", "eval_fraction"),
    "engine": ("kind", "stage", "precision", "config", "offload_optimizer", "offload_param", "sharding", "wrap"),
    "sweep": ("grid", "points", "max_parallel"),
    "env": ("A", ""),
}
FIELDS = ["name", "steps", "seed", "workdir", "sweep.grid.seed", "sweep.grid.optimizer.lr", "engine.config.zero_optimization"]
FIELDS += [f"{section}.{field}" for section, fields in SECTIONS.items() for field in fields]

EDGE_TEXT = ["", " ", "0", "-1", "1e30", "1.0e+30", ".inf", ".nan", "1:30:00", "0G", "16G", "9" * 40, "~nouser/x", "%j",
             "a" * 300, "x\ny", "ddp", "deepspeed", "hf", "script", "zero", "a..b", "true", "null", "&a [*a]"]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([10**29, 10**31, 2**63, 2**64, -(2**63) - 1, 4301 * 10**0]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(EDGE_TEXT),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["a", "stage", "kind", "x.y", ""]), inner, max_size=3)),
    max_leaves=12,
)


def attempt(text: str, overrides: list[str] = ()) -> Spec | None:
    """Load (and expand) ``text``: a Spec, or None where it raised SpecError; fails on
    any other exception or a slow answer."""
    path = WORK / "s.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    start = time.monotonic()
    try:
        spec, raw, lines = load_spec(path, list(overrides))
        expand(spec, raw, lines, str(path))
        result = spec
    except SpecError as exc:
        for issue in exc.issues:  # every issue says where: a line of the file, or `--set` without one
            assert issue.source in (str(path), "--set"), issue
            assert issue.source != "--set" or issue.line is None, issue
        assert len(str(exc)) < 20_000  # a list of many errors is cut, not a flood
        result = None
    elapsed = time.monotonic() - start
    assert elapsed < SECONDS, f"{elapsed:.1f} s for {text[:200]!r} {overrides!r}"
    return result


def set_at(data: dict, path: list[str], value) -> dict:
    data = copy.deepcopy(data)
    cur = data
    for part in path[:-1]:
        if not isinstance(cur.get(part), dict):
            cur[part] = {}
        cur = cur[part]
    cur[path[-1]] = value
    return data


def dump(data) -> str:
    return yaml.safe_dump(data, allow_unicode=False, sort_keys=False)  # escapes control characters: the loader sees them


@FUZZ
@given(st.sampled_from(BASES), st.lists(st.tuples(st.sampled_from(FIELDS), values), min_size=1, max_size=3))
def test_mutated_configs_load_or_raise_spec_error(base, changes):
    data = base
    for field, value in changes:
        data = set_at(data, field.split("."), value)
    attempt(dump(data))


@FUZZ
@given(st.sampled_from(list(CONFIGS.values())), st.integers(min_value=0), st.sampled_from(
    ["\x00", "\x01", "\x07", "\x1b", "\x7f", "\x85", "\x9b", "\ufffe", "\t", "\r", "\u2028", "[", "{", "&a", "*a", ": ", "- ", "!!binary ", "<<: *a\n", "'", '"']
))
def test_config_text_with_a_character_spliced_in_loads_or_raises_spec_error(text, where, char):
    i = where % (len(text) + 1)
    attempt(text[:i] + char + text[i:])


@FUZZ
@given(st.text(max_size=200))
def test_random_text_loads_or_raises_spec_error(text):
    attempt(text)


@FUZZ
@given(
    st.sampled_from(list(CONFIGS.values())),
    st.lists(
        st.tuples(
            st.one_of(st.sampled_from(FIELDS), st.text(st.characters(exclude_categories=("Cs",)), max_size=15)),
            st.one_of(st.sampled_from(EDGE_TEXT + ["{kind: deepspeed, config: {zero_optimization: 5}}", "[" * 40, "[1, x]"]),
                      values.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip()),
                      st.text(st.characters(exclude_categories=("Cs",)), max_size=15)),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_set_items_load_or_raise_spec_error_on_set(text, items):
    attempt(text, [f"{key}={value}" for key, value in items])


def bomb(width: int, depth: int) -> str:
    out = "a0: &a0 [" + ", ".join(["lol"] * width) + "]\n"
    for i in range(1, depth + 1):
        out += f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]\n"
    return out


@FUZZ
@given(st.integers(2, 12), st.integers(1, 12), st.booleans())
def test_alias_bombs_are_refused_or_small(width, depth, inside):
    text = "name: x\nsteps: 1\n"
    if inside:  # in a field that takes anything
        text += "model:\n  kind: entrypoint\n  entrypoint: 'a:b'\n  kwargs:\n" + "".join("    " + line + "\n" for line in bomb(width, depth).splitlines())
    else:
        text += bomb(width, depth)
    attempt(text)


@FUZZ
@given(st.integers(1, 3000), st.sampled_from(["[", "{a: ", "- ", "{? "]), st.sampled_from(["model: ", "x: ", "engine:\n  kind: deepspeed\n  config: "]))
def test_deep_nesting_is_refused_or_loads(depth, opener, where):
    closer = {"[": "]", "{a: ": "}", "{? ": "}", "- ": ""}[opener]
    if opener == "- ":
        body = "".join("  " * i + "- " + "\n" for i in range(min(depth, 200)))
    else:
        body = opener * depth + "1" + closer * depth
    attempt("name: x\nsteps: 1\n" + where + body + "\n")


@FUZZ
@given(st.integers(min_value=25, max_value=6000), st.sampled_from(["", "-", "0x", "0b1", "0", "1_"]), st.sampled_from(FIELDS))
def test_huge_integers_are_refused_or_load(digits, prefix, field):
    attempt(dump(set_at(BASES[0], field.split("."), 0)).replace(": 0\n", f": {prefix}{'1' * digits}\n", 1))


@settings(FUZZ, max_examples=EXAMPLES or 40)  # a sweep under the cap is expanded: up to seconds each
@given(st.lists(st.integers(0, 60), min_size=1, max_size=5), st.integers(0, 30))
def test_sweeps_of_any_size_are_refused_or_expanded_quickly(lengths, points):
    grid = {key: list(range(n)) for key, n in zip(("seed", "schedule.warmup_steps", "logging.every_steps", "data.seed", "eval.max_batches"), lengths)}
    sweep = {"grid": grid} | ({"points": [{"optimizer.lr": 0.001 * (i + 1)} for i in range(points)]} if points else {})
    attempt(dump({"name": "x", "steps": 10, "sweep": sweep}))


# ------------------------------------------------------------------ the CLI, in a subprocess

NASTY = {
    "alias-bomb": ("name: x\nsteps: 1\n" + bomb(10, 9), [], "more than 100000 values"),
    "recursive-alias": ("name: x\nsteps: 1\nx: &a [*a]\n", [], "recursive structure"),
    "deep": ("name: x\nsteps: 1\nmodel: " + "[" * 100_000 + "]" * 100_000 + "\n", [], "nested more than"),
    "control-character": ("name: x\nsteps: 1\nenv: {A: \"\\x07\"}\n", [], "U+0007"),
    "huge-int": ("name: x\nsteps: 1" + "0" * 5000 + "\n", [], "at most 30"),
    "huge-sweep": ("name: x\nsteps: 1\nsweep: {grid: {seed: [" + ", ".join(map(str, range(200))) + "], data.seed: ["
                   + ", ".join(map(str, range(200))) + "]}}\n", [], "40000 tasks"),
    "recursive-set": ("name: x\nsteps: 1\n", ["model=&a {x: *a}"], "--set: model: value refused"),
    "conflicting-set": ("name: x\nsteps: 1\n", ["model.n_layer=2", "model=4"], "conflicts with --set"),
}


@pytest.mark.parametrize("name", sorted(NASTY))
def test_cli_validate_refuses_the_nastiest_without_a_traceback(tmp_path, home, name):
    text, overrides, words = NASTY[name]
    spec = write(tmp_path / f"{name}.yaml", text)
    out = cli("validate", str(spec), *[a for o in overrides for a in ("--set", o)], home=home)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and words in out.stderr, out.stderr[-2000:]


def test_the_loader_bounds_are_what_the_errors_say():
    assert (yamlsrc.MAX_BYTES, yamlsrc.MAX_DEPTH, yamlsrc.MAX_NODES, yamlsrc.MAX_INT_DIGITS) == (1 << 20, 32, 100_000, 30)
