"""`eval.checkpoints` of kind `lm-eval`: the lm-eval harness, with its Hugging Face backend,
evaluates each exported checkpoint (and the base model, as step 0) on a task made for the
test from local files; nothing is downloaded."""

import json
import sys

import pytest

from conftest import REPO, cli, write
from orchestrator import contract

pytestmark = pytest.mark.multiproc
pytest.importorskip("lm_eval")  # the lm-eval extra: `make install` has it, so CI runs this

sys.path.insert(0, str(REPO / "tests" / "hf"))
import tiny  # noqa: E402

SPEC = """\
name: harness
model: {{kind: hf, path: {model}, lora: {{r: 4, alpha: 8}}}}
data: {{kind: jsonl, path: {data}, max_length: 48}}
optimizer: {{lr: 1.0e-2}}
batch: {{micro_batch_size: 2}}
steps: 4
checkpoint: {{every_steps: 2, keep_last: 1}}
resources: {{tasks_per_node: 1}}
eval:
  checkpoints: {{kind: lm-eval, tasks: [sums], include_path: lm-tasks, limit: 4, base: true, every: 2}}
"""
TASK = """\
task: sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: " {{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: perplexity
"""


def test_the_harness_evaluates_the_base_and_each_due_checkpoint_from_local_files(home, tmp_path, tiny_model):
    data = tiny.make_chat_data(tmp_path / "train.jsonl", n=16)
    tasks = tmp_path / "lm-tasks"
    tasks.mkdir()
    (tasks / "sums.jsonl").write_text("".join(json.dumps({"question": f"{i} + {i}", "answer": str(2 * i)}) + "\n" for i in range(6)))
    (tasks / "sums.yaml").write_text(TASK.format(data=tasks / "sums.jsonl"))
    out = cli("submit", str(write(tmp_path / "exp.yaml", SPEC.format(model=tiny_model, data=data))), "--executor", "local",
              "--wait", "--json", home=home, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    exp = json.loads(out.stdout)["experiments"][0]
    tdir = contract.task_dir(exp["run_dir"], 0)
    doc = json.loads(cli("status", exp["id"], "--json", home=home).stdout)["experiments"][0]["tasks"][0]["evaluations"]
    assert doc["done"] == 2, doc
    results = {s: json.loads(contract.eval_result_path(tdir, s).read_text()) for s in (0, 4)}
    for step, result in results.items():
        assert result["kind"] == "lm-eval" and result["n"] == 4
        assert set(result["metrics"]) == {"sums.acc", "sums.perplexity"}, result["metrics"]
    assert results[0]["checkpoint"] == "base" and results[4]["checkpoint"] == "step-000000004"  # the final step: saved to be evaluated
    # the trained adapter, not the base, was evaluated at step 4
    assert results[0]["metrics"]["sums.perplexity"] != results[4]["metrics"]["sums.perplexity"]
    assert not contract.eval_dir(tdir, 2).exists()  # every: 2 — step 2 was not due
