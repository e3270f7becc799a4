import json

import pytest

from conftest import cli, write
from orchestrator.errors import SpecError
from orchestrator.spec.load import load_spec
from orchestrator.spec.sweep import expand

GOOD = "name: ok\nsteps: 10\n"


def issues_of(path, overrides=()):
    with pytest.raises(SpecError) as exc:
        spec, raw, lines = load_spec(path, list(overrides))
        expand(spec, raw, lines, str(path))
    return exc.value.issues


def test_every_error_is_reported_with_path_and_line(tmp_path):
    p = write(
        tmp_path / "bad.yaml",
        "name: demo\n"  # 1
        "model:\n"  # 2
        "  n_layer: two\n"  # 3
        "resources:\n"  # 4
        "  nodes: 1\n"  # 5
        "  tim: '01:00:00'\n",  # 6  ... and `steps` is missing
    )
    issues = {i.path: i for i in issues_of(p)}
    assert set(issues) == {"steps", "model.n_layer", "resources.tim"}
    assert issues["model.n_layer"].line == 3 and "integer" in issues["model.n_layer"].message
    assert issues["resources.tim"].line == 6
    assert "unknown key 'tim'" in issues["resources.tim"].message and "time" in issues["resources.tim"].message
    assert issues["steps"].message == "required field is missing"


def test_unknown_key_of_a_variant_lists_that_variants_keys(tmp_path):
    p = write(tmp_path / "s.yaml", "name: x\nsteps: 1\ndata:\n  kind: text\n  path: a.txt\n  vocab_size: 3\n")
    (issue,) = issues_of(p)
    assert issue.path == "data.vocab_size" and issue.line == 6
    assert "valid keys: kind, path" in issue.message


def test_unknown_kind_names_the_valid_kinds(tmp_path):
    p = write(tmp_path / "s.yaml", "name: x\nsteps: 1\nengine:\n  kind: horovod\n")
    (issue,) = issues_of(p)
    assert issue.path == "engine.kind" and issue.line == 4 and "'ddp'" in issue.message


def test_malformed_yaml_and_duplicate_keys(tmp_path):
    (issue,) = issues_of(write(tmp_path / "m.yaml", "name: x\nsteps: [1,\n"))
    assert issue.message.startswith("malformed YAML") and issue.line == 3
    (issue,) = issues_of(write(tmp_path / "d.yaml", "name: x\nsteps: 1\nsteps: 2\n"))
    assert "duplicate key 'steps'" in issue.message and issue.line == 3


def test_set_overrides_are_typed_and_blamed_on_the_command_line(tmp_path):
    p = write(tmp_path / "s.yaml", GOOD)
    spec, _, _ = load_spec(p, ["optimizer.lr=0.02", "resources.tasks_per_node=4", "env.FOO=bar"])
    assert spec.optimizer.lr == 0.02 and spec.resources.tasks_per_node == 4 and spec.env == {"FOO": "bar"}
    (issue,) = issues_of(p, ["resources.nodes=many"])
    assert issue.source == "--set" and issue.line is None and issue.path == "resources.nodes"


def test_slurm_units_are_checked(tmp_path):
    p = write(tmp_path / "s.yaml", GOOD + "resources:\n  time: 'soon'\n  mem: 12X\n")
    paths = {i.path for i in issues_of(p)}
    assert paths == {"resources.time", "resources.mem"}


def test_sweep_grid_times_points(tmp_path):
    p = write(
        tmp_path / "s.yaml",
        GOOD + "sweep:\n  grid:\n    optimizer.lr: [0.1, 0.01]\n    seed: [1, 2, 3]\n  points:\n    - {batch.micro_batch_size: 2}\n    - {batch.micro_batch_size: 4}\n",
    )
    spec, raw, lines = load_spec(p)
    tasks = expand(spec, raw, lines, str(p))
    assert len(tasks) == 12
    assert [t.index for t in tasks] == list(range(12))
    combos = {(t.spec.optimizer.lr, t.spec.seed, t.spec.batch.micro_batch_size) for t in tasks}
    assert len(combos) == 12
    assert tasks[0].params == {"batch.micro_batch_size": 2, "optimizer.lr": 0.1, "seed": 1}


def test_no_sweep_is_one_task(tmp_path):
    p = write(tmp_path / "s.yaml", GOOD)
    spec, raw, lines = load_spec(p)
    (task,) = expand(spec, raw, lines, str(p))
    assert task.params == {} and task.spec.steps == 10


def test_sweep_rejects_resources_and_bad_values(tmp_path):
    p = write(tmp_path / "s.yaml", GOOD + "sweep:\n  grid:\n    resources.nodes: [1, 2]\n")
    (issue,) = issues_of(p)
    assert issue.line == 5 and "cannot vary across a sweep" in issue.message
    p = write(tmp_path / "t.yaml", GOOD + "sweep:\n  grid:\n    optimizer.lr: [0.1, -1]\n    optimizer.lrr: [1]\n")
    messages = [i.message for i in issues_of(p)]
    assert any("greater than 0" in m for m in messages)
    assert any("unknown key 'lrr'" in m for m in messages)


def test_cli_validate_prints_all_errors_without_traceback(tmp_path, home):
    p = write(tmp_path / "bad.yaml", "name: demo\nmodel:\n  n_layer: two\n  colour: red\n")
    out = cli("validate", str(p), home=home)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    for needle in ("bad.yaml:3: model.n_layer", "bad.yaml:4: model.colour: unknown key 'colour'", "steps: required field is missing"):
        assert needle in out.stderr
    bad = write(tmp_path / "mal.yaml", "name: [\n")
    out = cli("validate", str(bad), home=home)
    assert out.returncode == 2 and "malformed YAML" in out.stderr and "Traceback" not in out.stderr
    out = cli("validate", str(tmp_path / "missing.yaml"), home=home)
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_cli_validate_accepts_the_shipped_configs(home):
    for name in ("smoke", "sweep"):
        out = cli("validate", f"configs/{name}.yaml", home=home)
        assert out.returncode == 0, out.stderr


def test_schema_is_json_schema_of_every_field(home):
    out = cli("schema", home=home)
    schema = json.loads(out.stdout)
    assert schema["required"] == ["name", "steps"]
    assert {"model", "engine", "resources", "sweep", "checkpoint", "retry", "heartbeat"} <= set(schema["properties"])


def test_reference_says_which_trainers_act_on_a_field():
    from orchestrator.spec.experiment import Spec
    from orchestrator.spec.reference import rows

    meaning = {path: m for path, _, _, m in rows(Spec)}
    trainer = "*Built-in trainer only; a `script` or `command` model ignores it.*"
    assert meaning["checkpoint.every_steps"].endswith(trainer)
    assert meaning["schedule.warmup_steps"].endswith(trainer)  # from its section's marker
    assert meaning["data[kind=jsonl/parquet/arrow].path"].endswith(trainer)
    assert "a `command` without one ignores it" in meaning["checkpoint.keep_last"]
    assert "a `command` without one ignores it" in meaning["checkpoint.consolidate.dtype"]
    assert "not the built-in trainer" in meaning["heartbeat.save_timeout_s"]
    assert "only in the DeepSpeed config" in meaning["optimizer.grad_clip"]  # its own, over the section's
    assert "only in the DeepSpeed config" in meaning["batch.micro_batch_size"]
    for every_kind in ("checkpoint.signal", "heartbeat.timeout_s", "retry.max_restarts", "resources.nodes", "env"):
        assert "trainer" not in meaning[every_kind], every_kind


def test_docs_spec_reference_is_current():
    from conftest import REPO
    from orchestrator.spec.reference import BEGIN, END, markdown_reference

    text = (REPO / "docs" / "reference" / "spec.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "the generated block's markers are gone"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")
    assert block == markdown_reference(), "regenerate with scripts/regen-docs-reference"
    # every field of the spec has its row
    assert block.count("\n| `") > 100 and "| `name` | str | **required** |" in block
