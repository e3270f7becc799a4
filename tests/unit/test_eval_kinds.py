"""The kinds of `eval.checkpoints` (generate, lm-eval, command) as a spec takes them, what
each asks of submission, and the pure parts of their runners and of an evaluation's SLURM
job: the harness's results as metric names, a program's metrics file read untrusted, the
job's request made from the experiment's."""

import json

import pytest

from conftest import cli, write
from orchestrator.scheduler.slurm_eval import evaluation_parameters
from orchestrator.spec.checkpoint_eval import CheckpointEval, EvalResources
from train_entry.checkpoint_eval import EvalError, harness, program

SPEC = """\
name: kinds
model: {{kind: hf, path: {model}, lora: {{r: 4}}}}
data: {{kind: jsonl, path: {data}}}
steps: 4
eval:
  checkpoints:
{section}
"""


@pytest.mark.parametrize("section, field, message", [
    ("    kind: lm-eval\n    tasks: [sums]", "eval.checkpoints.include_path", "kind lm-eval needs include_path"),
    ("    kind: command\n    argv: [x]\n    prompts: p.jsonl", "eval.checkpoints.prompts", "prompts is for kind generate, not command"),
    ("    kind: generate", "eval.checkpoints.prompts", "kind generate needs prompts"),
    ("    kind: lm-eval\n    tasks: [nope]\n    include_path: tasks", "eval.checkpoints.tasks[0]", "no task 'nope' in the YAMLs"),
    ("    kind: command\n    argv: [no-such-program-here, '{model}']", "eval.checkpoints.argv[0]", "no program 'no-such-program-here'"),
    ("    kind: command\n    argv: [./score.py]\n    base: true\n    resources: {partition: 'a;b'}", "eval.checkpoints.resources.partition", ""),
    ("    prompts: d.jsonl\ncheckpoint: {consolidate: {which: best}}", "checkpoint.consolidate.which", "set checkpoint.keep_best"),
])
def test_each_kind_names_what_it_lacks_before_anything_is_queued(tmp_path, home, section, field, message):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "sums.yaml").write_text("task: sums\ndataset_path: json\nmetric_list: [{metric: !function m.f}]\n")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n')
    spec = write(tmp_path / "exp.yaml", SPEC.format(model="model", data="d.jsonl", section=section))
    out = cli("validate", str(spec), home=home)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert field in out.stderr and message in out.stderr, out.stderr


def test_keep_best_of_a_kind_whose_results_name_the_metrics_is_not_checked_against_a_list():
    assert CheckpointEval.model_validate({"kind": "lm-eval", "tasks": ["a"], "include_path": "t"}).metric_names() is None
    assert CheckpointEval.model_validate({"prompts": "p", "score": "m:f"}).metric_names() == ["exact_match", "f"]


def test_the_harness_results_become_metric_names_a_result_record_takes():
    got = harness.flatten({
        "sums": {"alias": "sums", "exact_match,none": 0.5, "exact_match_stderr,none": "N/A", "sample_len": 6},
        "gsm": {"exact_match,strict-match": 0.25, "exact_match,flexible extract": 1.0, "acc,none": float("nan")},
    })
    assert got == {"gsm.exact_match.flexible_extract": 1.0, "gsm.exact_match.strict-match": 0.25, "sums.exact_match": 0.5}


@pytest.mark.parametrize("content, said", [
    (None, "wrote no"), (b"[1, 2]", "expected an object"), (b'{"a b": 1}', "is not a metric name"),
    (b'{"acc": "high"}', ""), (b"{" * 10, ""), (b" " * (program.MAX_BYTES + 1), "over"),
])
def test_a_programs_metrics_file_is_read_untrusted(tmp_path, content, said):
    path = tmp_path / "metrics.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(EvalError, match=said):
        program.read_metrics(path, "score.py")
    path.write_text(json.dumps({"accuracy": 0.75, "f1": 1}))
    assert program.read_metrics(path, "score.py") == {"accuracy": 0.75, "f1": 1.0}


def test_a_command_gets_the_exported_folder_and_where_to_write(tmp_path):
    from train_entry.checkpoint_eval.run import Loadable, Settings

    script = tmp_path / "score.py"
    script.write_text("import json, os, sys\njson.dump({'model_is_arg': int(sys.argv[1] == os.environ['ORCHESTRATE_EVAL_MODEL']), "
                      "'n': len(os.listdir(sys.argv[1]))}, open(sys.argv[2], 'w'))\n")
    model = tmp_path / "merged"
    model.mkdir()
    (model / "config.json").write_text("{}")
    settings = Settings(kind="command", argv=("python3", str(script), "{model}", "{metrics}"), timeout_s=60)
    assert program.evaluate(Loadable(model, None, None), tmp_path, settings) == {"metrics": {"model_is_arg": 1.0, "n": 1.0}}
    failing = Settings(kind="command", argv=("python3", "-c", "raise SystemExit(3)"), timeout_s=60)
    with pytest.raises(EvalError, match="exited with 3"):
        program.evaluate(Loadable(model, None, None), tmp_path, failing)


def test_an_evaluation_job_takes_the_experiments_request_but_its_own_size_and_is_never_requeued():
    params = {"job_name": "x-eval-0-3", "nodes": 4, "ntasks_per_node": 1, "cpus_per_task": 16, "gpus_per_node": 8, "time": 600,
              "partition": "gpu", "account": "proj", "array_parallelism": 4, "signal_delay_s": 120,
              "additional_parameters": {"requeue": True, "signal": "USR1@120", "mail_type": "END", "mem": "4000M",
                                        "dependency": "afterany:1", "reservation": "r1"}}
    evaluation_parameters(params, EvalResources(partition="eval", gpus=1, cpus=4, mem="16G"), 30)
    assert params == {"job_name": "x-eval-0-3", "nodes": 1, "ntasks_per_node": 1, "cpus_per_task": 4, "gpus_per_node": 1,
                      "time": 31, "partition": "eval", "account": "proj",
                      "additional_parameters": {"reservation": "r1", "no_requeue": True, "mem": "16384M"}}
    evaluation_parameters(params, EvalResources(), 0.5)  # unset: the experiment's partition, no GPU
    assert params["partition"] == "eval" and "gpus_per_node" not in params and params["time"] == 2
