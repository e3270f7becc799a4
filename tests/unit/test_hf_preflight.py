"""What the login node checks before queueing a `model: {kind: hf}` / `data: {kind: jsonl}`
experiment: each problem is an error naming the spec file, line and field (and the data
file and line), the command exits non-zero without a traceback, and nothing is queued:
no run folder, no experiment in the ledger. No training happens here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from conftest import CHILD_TIMEOUT_S, REPO, cli, write
from orchestrator.ledger import Ledger

sys.path.insert(0, str(REPO / "tests" / "hf"))
import tiny  # noqa: E402

if not os.environ.get("CI"):  # CI installs the hf extra, so there it must run
    pytest.importorskip("transformers")

SPEC = """\
name: preflight
workdir: {runs}
model:
  kind: hf
  path: {model}
  lora:
    r: 8
    target_modules: {targets}
data: {{kind: jsonl, path: {data}, max_length: 64{extra}}}
engine: {{kind: ddp}}
batch: {{micro_batch_size: 2}}
steps: 2
"""


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    return tiny.make_chat_data(tmp_path_factory.mktemp("data") / "train.jsonl", n=8)


def make_spec(tmp_path, model, data, targets="[q_proj, v_proj]", extra="") -> Path:
    return write(tmp_path / "exp.yaml", SPEC.format(runs=tmp_path / "runs", model=model, data=data, targets=targets, extra=extra))


def lines_of(path: Path, *records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


GOOD = {"messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}]}


def refused(out, home, spec: Path, *expected: str) -> str:
    """The command failed as a user error, said each expected thing, and queued nothing."""
    assert out.returncode != 0, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    for text in expected:
        assert text in out.stderr, (text, out.stderr)
    assert str(spec) in out.stderr  # the spec file is named
    runs = spec.parent / "runs"
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())
    if (home / "ledger.db").exists():
        assert Ledger.open(home / "ledger.db").find_experiments() == []
    return out.stderr


def test_a_line_that_is_not_json(home, tmp_path, tiny_model):
    data = lines_of(tmp_path / "d.jsonl", GOOD, GOOD, '{"messages": [oops', GOOD)
    spec = make_spec(tmp_path, tiny_model, data)
    out = cli("submit", str(spec), "--executor", "local", home=home)
    err = refused(out, home, spec, f"{spec}:9: data.path: {data}:3: not JSON", "fix or remove that line")
    assert "1 problem found before queueing anything" in err


def test_a_record_without_messages(home, tmp_path, tiny_model):
    data = lines_of(tmp_path / "d.jsonl", GOOD, "", {"prompt": "abc", "completion": "cba"}, GOOD)
    spec = make_spec(tmp_path, tiny_model, data)
    out = cli("submit", str(spec), "--executor", "local", home=home)
    refused(out, home, spec, "data.path:", f"{data}:3: a chat record needs a non-empty list 'messages' (data.format: chat)")


def test_a_model_folder_without_config_json(home, tmp_path, chat_data):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    spec = make_spec(tmp_path, folder, chat_data)
    out = cli("submit", str(spec), "--executor", "local", home=home)
    refused(out, home, spec, f"{spec}:5: model.path: '{folder}' has no config.json", "save_pretrained")


def test_a_lora_target_the_model_does_not_have(home, tmp_path, tiny_model, chat_data):
    spec = make_spec(tmp_path, tiny_model, chat_data, targets="[q_proj, qkv, mlp]")
    out = cli("submit", str(spec), "--executor", "local", home=home)
    err = refused(out, home, spec, f"{spec}:8: model.lora.target_modules[1]: 'qkv' is not a module of this model (LlamaForCausalLM)",
                  "model.lora.target_modules[2]: 'mlp' names LlamaMLP modules, not linear layers")
    assert "the linear layers it has: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head" in err
    assert "target_modules[0]" not in err


def test_validate_and_dry_run_report_every_problem_at_once(home, tmp_path, tiny_model):
    data = lines_of(tmp_path / "d.jsonl", GOOD, {"messages": [{"role": "user", "content": "no answer"}]})
    spec = make_spec(tmp_path, tiny_model, data, targets="[q_proj, nope]", extra=", eval_path: missing.jsonl")
    for argv in (["validate", str(spec)], ["submit", str(spec), "--dry-run", "--executor", "local"]):
        out = cli(*argv, home=home)
        err = refused(out, home, spec, "3 problems found before queueing anything",
                      "target_modules[1]: 'nope' is not a module", f"{data}:2: no assistant message",
                      f"data.eval_path: no file '{tmp_path / 'missing.jsonl'}'")
        assert out.returncode == 2 and out.stdout == "", (out.stdout, err)
    assert not (home / "ledger.db").exists()


def test_a_valid_spec_passes(home, tmp_path, tiny_model, chat_data):
    spec = make_spec(tmp_path, tiny_model, chat_data, extra=", eval_fraction: 0.25")
    out = cli("validate", str(spec), home=home)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert "valid, 1 task(s)" in out.stdout


# ---------------------------------------------------------------- in process: the checks themselves


def test_eval_fraction_must_leave_a_record_on_each_side(tmp_path):
    from orchestrator.contract.chatdata import held_out_count
    from orchestrator.spec.hf import JsonlData
    from orchestrator.submit.preflight import _Checker
    from train_entry.dataprep.store import held_out

    for n in range(1, 12):  # the count the trainer's split holds out
        for f in (0.01, 0.3, 0.5, 0.9, 0.99):
            assert held_out_count(n, f) == len(held_out(n, f, 0))

    def problems(n, fraction):
        data = lines_of(tmp_path / f"d{n}.jsonl", *[GOOD] * n)
        return _Checker().data(JsonlData(kind="jsonl", path=str(data), eval_fraction=fraction))

    assert problems(1, 0.5) and "holds out 0 and leaves 1" in problems(1, 0.5)[0][1]
    assert problems(2, 0.9) and "holds out 2 and leaves 0" in problems(2, 0.9)[0][1]
    assert problems(2, 0.5) == [] and problems(10, 0.05) == []
    assert problems(0, 0.5) == [(("data", "path"), f"no records in '{tmp_path / 'd0.jsonl'}': nothing to train on")]


def test_folder_checks(tmp_path, tiny_model):
    from orchestrator.submit.preflight import folder_problems

    def training(folder, gguf=None):  # what only training needs; nothing a plan needs is missing
        needed, only_training = folder_problems(str(folder), gguf)
        assert needed == []
        return only_training

    assert training(tiny_model) == []
    no_template = tmp_path / "plain"
    no_template.mkdir()
    for f in tiny_model.iterdir():
        (no_template / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((no_template / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (no_template / "tokenizer_config.json").write_text(json.dumps(cfg))
    (no_template / "chat_template.jinja").unlink(missing_ok=True)
    (msg,) = training(no_template)
    assert "no chat template" in msg[1]
    (no_template / "tokenizer.json").unlink()
    (msg,) = training(no_template)
    assert "no tokenizer files" in msg[1]
    for f in no_template.glob("*.safetensors"):
        f.unlink()
    assert any("no weights" in m for _, m in training(no_template))
    ((field, msg),), _ = folder_problems(str(tiny_model), "model.gguf")
    assert field == ("model", "gguf_file") and "no file 'model.gguf'" in msg
    (needed,), _ = folder_problems(str(tmp_path / "absent"), None)
    assert "no folder" in needed[1]


def test_a_folder_with_config_json_alone_is_enough_to_plan_and_validate_not_to_submit(home, tmp_path, tiny_model, chat_data):
    """Which engine fits a model is a question asked before its weights are downloaded."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_bytes((tiny_model / "config.json").read_bytes())
    spec = tmp_path / "s.yaml"
    spec.write_text(f"name: c\nsteps: 2\nmodel: {{kind: hf, path: {config_only}, lora: {{r: 4}}}}\n"
                    f"data: {{kind: jsonl, path: {chat_data}}}\nresources: {{tasks_per_node: 2}}\n")
    plan = cli("plan", str(spec), "--json", home=home)
    assert plan.returncode == 0, plan.stderr
    doc = json.loads(plan.stdout)
    assert doc["not_checked"] and any("no weights" in n for n in doc["not_checked"]), doc["not_checked"]
    assert any("plan reads no data" in n for n in doc["not_checked"])
    valid = cli("validate", str(spec), home=home)
    assert valid.returncode == 0 and "valid" in valid.stdout and "not checked:" in valid.stdout, valid.stdout + valid.stderr
    assert "no tokenizer files" in valid.stdout and "(submit checks it)" in valid.stdout
    sub = cli("submit", str(spec), "--dry-run", home=home)
    assert sub.returncode == 2 and "no weights" in sub.stderr and "Traceback" not in sub.stderr, sub.stderr


def test_without_transformers_the_model_checks_are_skipped_with_a_warning(home, tmp_path, tiny_model, chat_data):
    """A login node without the hf extra: one warning line, the file checks still made."""
    import subprocess

    block = tmp_path / "block"
    block.mkdir()
    (block / "transformers.py").write_text("raise ImportError('no transformers here', name='transformers')\n")
    spec = make_spec(tmp_path, tiny_model, chat_data, targets="[q_proj, nope]")
    # a cache of its own: an outline kept from an earlier check would need no transformers at all
    env = {**os.environ, "ORCHESTRATE_HOME": str(home), "PYTHONPATH": str(block), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    out = subprocess.run([sys.executable, "-m", "orchestrator", "validate", str(spec)], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=CHILD_TIMEOUT_S)
    assert out.returncode == 0, out.stderr  # 'nope' is left to the compute nodes
    (warning,) = out.stderr.splitlines()
    assert warning.startswith("warning: transformers is not importable") and "not checked" in warning
    bad = make_spec(tmp_path, tmp_path / "nowhere", chat_data)
    out = subprocess.run([sys.executable, "-m", "orchestrator", "validate", str(bad)], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=CHILD_TIMEOUT_S)
    assert out.returncode == 2 and f"model.path: no folder '{tmp_path / 'nowhere'}'" in out.stderr


def test_paths_a_sweep_sets_are_taken_from_the_spec_folder_too(tmp_path, tiny_model, chat_data):
    from orchestrator.submit.submission import make_plan

    (tmp_path / "other.jsonl").write_bytes(chat_data.read_bytes())
    spec = make_spec(tmp_path, tiny_model, chat_data)
    spec.write_text(spec.read_text() + "sweep: {grid: {data.path: [other.jsonl, ../" + tmp_path.name + "/other.jsonl]}}\n")
    plan = make_plan(str(spec), [], "local", tmp_path / "home")
    assert [t.config.data["path"] for t in plan.tasks] == [str(tmp_path / "other.jsonl")] * 2
    assert [t.params for t in plan.tasks][0] == {"data.path": "other.jsonl"}  # as written, for the user


def test_data_as_a_glob_a_list_parquet_files_or_a_saved_data_set(home, tmp_path, tiny_model, chat_data):
    """A glob is expanded once, at submit, sorted; every input is checked as JSON lines are;
    errors name the list item and the file's row."""
    import datasets

    from orchestrator.errors import SpecError
    from orchestrator.submit.submission import make_plan

    rows = [json.loads(line) for line in chat_data.read_text().splitlines()]
    parts = tmp_path / "parts"
    parts.mkdir()
    for i in (2, 1):
        datasets.Dataset.from_list(rows).to_parquet(str(parts / f"train-{i}.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    spec = make_spec(tmp_path, tiny_model, chat_data)

    def data(text: str) -> Path:
        spec.write_text(spec.read_text().splitlines(keepends=True)[0] + "".join(
            line if not line.startswith("data:") else text + "\n" for line in spec.read_text().splitlines(keepends=True)[1:]))
        return spec

    plan = make_plan(str(data("data: {kind: parquet, path: parts/train-*.parquet, eval_path: [parts/train-1.parquet]}")), [],
                     "local", home)
    assert list(plan.tasks[0].config.data["path"]) == [str(parts / "train-1.parquet"), str(parts / "train-2.parquet")]
    assert list(plan.tasks[0].config.data["eval_path"]) == [str(parts / "train-1.parquet")]
    assert make_plan(str(data("data: {kind: arrow, path: saved}")), [], "local", home).tasks[0].config.data["path"] == \
        str(tmp_path / "saved")

    with pytest.raises(SpecError, match=r"exp.yaml:9: data.path: 'parts/nope-\*.parquet' matches no file"):
        make_plan(str(data("data: {kind: parquet, path: parts/nope-*.parquet}")), [], "local", home)
    datasets.Dataset.from_list(rows[:3] + [{"messages": []}]).to_parquet(str(parts / "bad.parquet"))
    out = cli("validate", str(data("data: {kind: parquet, path: [parts/train-1.parquet, parts/bad.parquet, saved]}")), home=home)
    refused(out, home, spec, "2 problems", f"data.path: {parts / 'bad.parquet'} row 4: a chat record needs a non-empty "
            "list 'messages'", "fix or remove that row", f"data.path: '{tmp_path / 'saved'}' is a folder; give the Parquet "
            "file of records (a folder written by save_to_disk is data.kind: arrow)")
    for bad, why in (("5", "give a path, a glob pattern, or a list of them"), ("[a.parquet, 3]", "give a path"), ("''", "an empty path")):
        out = cli("validate", str(data("data: {kind: parquet, path: " + bad + "}")), home=home)
        assert out.returncode == 2 and out.stderr.count("data.path") == 1 and why in out.stderr, out.stderr  # one issue, the field named


@pytest.mark.timeout(2 * CHILD_TIMEOUT_S)  # two of its children import torch and transformers
def test_a_model_checked_before_is_checked_again_without_importing_torch(home, tmp_path, tiny_model, chat_data):
    """The login node keeps a checked config's outline by content: the next validate or submit
    of it imports neither torch nor transformers and finds the same problems; a damaged
    outline is ignored and written again."""
    import subprocess

    from orchestrator.submit import outlines

    spec = make_spec(tmp_path, tiny_model, chat_data, targets="[q_proj, nope]")
    env = {**os.environ, "ORCHESTRATE_HOME": str(home), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    probe = ("import sys; from orchestrator.cli.main import main; rc = main(['validate', sys.argv[1]]); "
             "print('imported', 'torch' in sys.modules, 'transformers' in sys.modules); sys.exit(rc)")

    def validate():
        out = subprocess.run([sys.executable, "-c", probe, str(spec)], capture_output=True, text=True, env=env, cwd=REPO, timeout=CHILD_TIMEOUT_S)
        assert out.returncode == 2 and "target_modules[1]: 'nope' is not a module of this model (LlamaForCausalLM)" in out.stderr
        return out.stdout.strip().splitlines()[-1]

    assert validate() == "imported True True"
    [kept] = (tmp_path / "xdg" / "orchestrate" / "outlines").iterdir()
    assert validate() == "imported False False"  # the same problem, found from the outline alone
    kept.write_text('{"key": "' + kept.stem + '", "shape": {}, "modules": [["a", "b", "weird"]]}')
    assert validate() == "imported True True"  # a damaged outline is not read
    assert outlines.read(kept.stem) is not None  # and was written again
