"""`orchestrate ckpt eval`: committed checkpoints of a LoRA fine-tune (model kind hf) are
exported and evaluated by generation, by hand: greedy answers to a prompts file, scored by
exact match, containment and a function of the user's; each result is written last into the
task's evals/step-N/ and read back as complete; a second run redoes nothing; a damaged
checkpoint is said and skipped, and the others go on."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, cli, write
from orchestrator import contract
from orchestrator.contract import records, safe_read

sys.path.insert(0, str(REPO / "tests" / "hf"))
import tiny  # noqa: E402

pytestmark = pytest.mark.multiproc

SPEC = """\
name: evals
model: {{kind: hf, path: {model}, lora: {{r: 4, alpha: 8}}}}
data: {{kind: jsonl, path: {data}, max_length: 48}}
optimizer: {{lr: 1.0e-2}}
batch: {{micro_batch_size: 2}}
steps: 10
checkpoint: {{every_steps: 3, keep_last: 3}}
resources: {{tasks_per_node: 1}}
"""
SCORER = """\
def first_word(answer, reference, prompt):
    # the user's own metric: the answer's first word is the reference's
    return answer.split()[:1] == reference.split()[:1]
"""


def test_checkpoints_are_evaluated_by_generation_and_the_results_kept(home, tmp_path, tiny_model, monkeypatch):
    data = tiny.make_chat_data(tmp_path / "train.jsonl", n=32)
    out = cli("submit", str(write(tmp_path / "exp.yaml", SPEC.format(model=tiny_model, data=data))), "--executor", "local",
              "--wait", "--json", home=home, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    tdir = contract.task_dir(json.loads(out.stdout)["experiments"][0]["run_dir"], 0)
    assert [s for s, _ in contract.committed_checkpoints(tdir)] == [9, 6, 3]

    # the held-out prompts: chats whose last message is the reference (the training data's format)
    prompts = tmp_path / "heldout.jsonl"
    recs = [json.loads(line) for line in data.read_text().splitlines()[:6]]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "myscore.py").write_text(SCORER)
    monkeypatch.chdir(tmp_path)  # --score module:function, importable from the working folder
    first = cli("ckpt", "eval", str(tdir), "--all", "--prompts", str(prompts), "--metric", "exact_match", "--metric",
                "contains", "--score", "myscore:first_word", "--max-new-tokens", "12", home=home, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    results = {s: safe_read.read_record(contract.eval_result_path(tdir, s), records.EVAL_RESULT) for s in (3, 6, 9)}
    for step, r in results.items():
        assert r["step"] == step and r["n"] == 6 and r["kind"] == "generate" and r["checkpoint"] == contract.checkpoint_name(step)
        assert set(r["metrics"]) == {"exact_match", "contains", "first_word"} and all(0 <= v <= 1 for v in r["metrics"].values())
        assert (contract.eval_dir(tdir, step) / "model" / "adapter" / "adapter_config.json").is_file()  # its export
        assert f"task 0 step {step}: exact_match" in first.stdout
    assert "best by exact_match" in first.stdout

    # the answers are the model's own: the export of step 9, loaded by hand, answers the same
    import peft
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = contract.eval_dir(tdir, 9) / "model" / "adapter"
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), adapter)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    ids = tok.apply_chat_template(recs[0]["messages"][:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    sample = results[9]["samples"][0]
    gen = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert tok.decode(gen[0][ids["input_ids"].shape[1]:], skip_special_tokens=True).strip() == sample["answer"]

    # references that are step 9's own answers (the same token limit): exact match 1 there; a
    # second run redoes nothing unless asked
    own = [{"prompt": r["messages"][:-1], "reference": s["answer"]} for r, s in zip(recs, results[9]["samples"])]
    (tmp_path / "own.jsonl").write_text("".join(json.dumps(r) + "\n" for r in own))
    again = cli("ckpt", "eval", str(tdir), "--prompts", str(tmp_path / "own.jsonl"), home=home, cwd=tmp_path)
    assert again.returncode == 0 and "evaluated before; --again to redo" in again.stderr, again.stderr
    redo = cli("ckpt", "eval", str(contract.checkpoints_dir(tdir) / contract.checkpoint_name(9)), "--prompts",
               str(tmp_path / "own.jsonl"), "--again", "--max-new-tokens", "12", "--json", home=home, cwd=tmp_path)
    assert redo.returncode == 0, redo.stderr
    assert [(r["step"], r["metrics"]) for r in json.loads(redo.stdout)] == [(9, {"exact_match": 1.0})]

    # a damaged checkpoint: said and skipped, no traceback; the others are evaluated
    shard = next(p for p in (contract.checkpoints_dir(tdir) / contract.checkpoint_name(6)).rglob("*") if p.is_file()
                 and p.name != contract.MANIFEST)
    shard.write_bytes(b"")
    for s in (3, 6, 9):
        contract.eval_result_path(tdir, s).unlink()
    hurt = cli("ckpt", "eval", str(tdir), "--all", "--prompts", str(prompts), home=home, cwd=tmp_path)
    assert "Traceback" not in hurt.stderr and f"task 0 {contract.checkpoint_name(6)}: not evaluated:" in hurt.stderr
    assert contract.eval_result_path(tdir, 3).is_file() and contract.eval_result_path(tdir, 9).is_file()
    assert not contract.eval_result_path(tdir, 6).exists()


def test_a_bad_prompts_file_names_its_line(home, tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n{"prompt": 3}\n')
    tdir = contract.task_dir(tmp_path / "run", 0)
    contract.checkpoints_dir(tdir).mkdir(parents=True)
    out = cli("ckpt", "eval", str(tdir), "--prompts", str(bad), home=home)
    assert out.returncode == 2 and f"{bad}:2:" in out.stderr and "Traceback" not in out.stderr, out.stderr


WATCHED = SPEC.replace("keep_last: 3", "keep_last: 2, keep_best: {{metric: answer_length, mode: min}}, "
                       "consolidate: {{which: best, dtype: bf16}}") + """\
eval: {{checkpoints: {{prompts: {prompts}, metrics: [exact_match, contains], score: "lengths:answer_length", retries: 1}}}}
"""
LENGTHS = "def answer_length(answer, reference, prompt):\n    return len(answer)\n"


# the watcher's evaluations run at nice 19 (they take the cycles training leaves): beside two
# other test streams that keep both cores busy they wait the longest (240-320 s measured)
@pytest.mark.timeout(900)
def test_the_watcher_evaluates_each_committed_checkpoint_and_a_killed_evaluation_is_tried_again(home, tmp_path, tiny_model):
    import os
    import signal
    import subprocess
    import time

    from orchestrator.ledger import Ledger

    data = tiny.make_chat_data(tmp_path / "train.jsonl", n=32)
    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text("".join(line + "\n" for line in data.read_text().splitlines()[:6]))
    (tmp_path / "lengths.py").write_text(LENGTHS)  # importable from the spec's folder
    spec = write(tmp_path / "exp.yaml", WATCHED.format(model=tiny_model, data=data, prompts=prompts.name))
    env = {**os.environ, "ORCHESTRATE_HOME": str(home)}
    run = subprocess.Popen([sys.executable, "-m", "orchestrator", "submit", str(spec), "--executor", "local", "--wait", "--json"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    killed = None
    deadline = time.time() + 240
    while killed is None and run.poll() is None and time.time() < deadline:  # the first evaluation, killed -9 while it runs
        time.sleep(0.2)
        if not (home / "ledger.db").exists():
            continue
        ledger = Ledger.open(home / "ledger.db")
        exps = ledger.find_experiments()
        running = [r for e in exps for r in ledger.evaluations(e["id"]) if r["state"] == "RUNNING" and r["pid"]]
        if running:
            killed = running[0]
            os.kill(killed["pid"], signal.SIGKILL)
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0 and killed is not None, err[-3000:]
    exp = json.loads(out)["experiments"][0]
    assert exp["state"] == "COMPLETED"  # training is never the evaluation's business
    ledger = Ledger.open(home / "ledger.db")
    rows = ledger.evaluations(exp["id"], 0)
    # the last step too: saved at the end because it is evaluated
    assert [(r["step"], r["state"]) for r in rows] == [(3, "DONE"), (6, "DONE"), (9, "DONE"), (10, "DONE")], rows
    assert {r["step"]: r["tries"] for r in rows} == {3: 1, 6: 1, 9: 1, 10: 1, killed["step"]: 2}
    assert all(set(r["metrics"]) == {"exact_match", "contains", "answer_length"} for r in rows)
    kinds = [(e["kind"], e["cause"]) for e in ledger.events(exp["id"]) if e["kind"].startswith("eval.")]
    results = [c for k, c in kinds if k == "eval.result"]
    assert len(results) == 4 and all(c.startswith(f"step {s}: ") for c, s in zip(results, (3, 6, 9, 10)))  # once each, in order
    retry = [c for k, c in kinds if k == "eval.retry"]
    assert len(retry) == 1 and f"evaluation of step {killed['step']} ended without a result (try 1 of 2)" in retry[0], kinds
    tdir = contract.task_dir(exp["run_dir"], 0)
    doc = exp["tasks"][0]["evaluations"]
    assert doc["done"] == 4 and doc["latest"]["step"] == 10 and set(doc["best"]) == {"exact_match", "contains", "answer_length"}

    # keep_best: the shortest answers' checkpoint is pinned (nothing else: no evaluation is
    # due), kept past keep_last 2 with its export; the others' exports are gone
    lengths = {r["step"]: r["metrics"]["answer_length"] for r in rows}
    best = min(lengths, key=lambda s: (lengths[s], -s))
    assert list(contract.read_pins(tdir)) == [best] and "best by answer_length" in contract.read_pins(tdir)[best]
    assert sorted(s for s, _ in contract.committed_checkpoints(tdir)) == sorted({best, 9, 10})
    assert {s: (contract.eval_dir(tdir, s) / "model").is_dir() for s in (3, 6, 9, 10)} == {s: s == best for s in (3, 6, 9, 10)}
    said = json.loads(cli("ckpt", "best", exp["id"], "--json", home=home).stdout)
    assert [(b["task"], b["step"], b["metric"]) for b in said] == [("0", best, "answer_length")]
    assert said[0]["export"] == str(contract.eval_dir(tdir, best) / "model") and said[0]["checkpoint"]
    assert any(e["kind"] == "eval.best" and e["cause"].startswith(f"step {best} is the best by answer_length")
               for e in ledger.events(exp["id"]))
    # consolidate.which: best: weights/ is the best one's export (bf16 as asked), made once
    # the evaluations were over; the job made none at the end of training
    import peft
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    weights = contract.weights_dir(tdir)
    assert json.loads((weights / contract.WEIGHTS_RECORD).read_text())["step"] == best
    with safe_open(str(weights / "adapter" / "adapter_model.safetensors"), "pt") as fh:
        assert {str(fh.get_tensor(k).dtype) for k in fh.keys()} == {"torch.bfloat16"}
    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), weights / "adapter")
    kinds = [(e["kind"], e["cause"]) for e in ledger.events(exp["id"]) if e["kind"].startswith("weights.")]
    assert [k for k, _ in kinds] == ["weights.deferred", "weights.best"], kinds
    assert kinds[1][1].startswith(f"step {best}, the best by answer_length")
    # the report: each metric against the step, the best starred, the tasks ranked by it
    rep = cli("report", exp["id"], "--json", home=home)
    assert rep.returncode == 0, rep.stderr
    doc = json.loads(rep.stdout)
    assert [e["step"] for e in doc["tasks"][0]["evaluations"]] == [3, 6, 9, 10]
    assert doc["ranking"]["metric"] == "answer_length" and doc["ranking"]["mode"] == "min"
    assert [(b["task"], b["step"]) for b in doc["ranking"]["tasks"]] == [(0, best)]
    page = tmp_path / "report.html"
    assert cli("report", exp["id"], "--out", str(page), home=home).returncode == 0
    html = page.read_text()
    assert 'id="evaluations"' in html and 'id="best-0"' in html and "Tasks by their best answer_length" in html


SLOW = "import time\n\ndef slow(answer, reference, prompt):\n    time.sleep(60)\n    return 1.0\n"


def test_cancel_stops_the_evaluations_that_outlive_training(home, tmp_path, tiny_model):
    """Training is over (COMPLETED); its checkpoints' evaluations still run: ``cancel`` stops them."""
    import os
    import subprocess
    import time

    from orchestrator.ledger import Ledger
    from orchestrator.scheduler.local import process_start_ticks

    data = tiny.make_chat_data(tmp_path / "train.jsonl", n=32)
    prompts = tmp_path / "heldout.jsonl"
    prompts.write_text("".join(line + "\n" for line in data.read_text().splitlines()[:2]))
    (tmp_path / "slowscore.py").write_text(SLOW)  # an evaluation that takes its time
    text = (SPEC + "eval: {{checkpoints: {{prompts: {prompts}, score: 'slowscore:slow'}}}}\n").format(
        model=tiny_model, data=data, prompts=prompts.name)
    env = {**os.environ, "ORCHESTRATE_HOME": str(home)}
    run = subprocess.Popen([sys.executable, "-m", "orchestrator", "submit", str(write(tmp_path / "exp.yaml", text)),
                            "--executor", "local", "--wait"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           env=env, cwd=tmp_path)
    running, deadline = None, time.time() + 240  # each evaluation takes 2 minutes: training ends first
    while running is None and time.time() < deadline and run.poll() is None:
        time.sleep(0.3)
        if (home / "ledger.db").exists():
            ledger = Ledger.open(home / "ledger.db")
            running = next((r for e in ledger.find_experiments() if e["state"] == "COMPLETED"
                            for r in ledger.evaluations(e["id"]) if r["state"] == "RUNNING"), None)
    assert running is not None, run.stderr.read()[-3000:] if run.poll() is not None else "no evaluation ran after training"
    said = cli("cancel", running["experiment_id"], home=home)
    assert said.returncode == 0 and "stopping the evaluations" in said.stdout, said.stdout
    run.wait(timeout=60)  # --wait returns: nothing is left to wait for
    ledger = Ledger.open(home / "ledger.db")
    rows = ledger.evaluations(running["experiment_id"])
    assert rows and all(r["state"] == "SKIPPED" and "its evaluations were cancelled" in r["reason"] for r in rows), rows
    assert ledger.experiment(running["experiment_id"])["state"] == "COMPLETED"  # training's outcome stands
    deadline = time.time() + 15  # SIGKILL is delivered, not waited for; a loaded machine reaps it a moment later
    while process_start_ticks(running["pid"]) == running["start_ticks"] and time.time() < deadline:
        time.sleep(0.1)
    assert process_start_ticks(running["pid"]) != running["start_ticks"]  # its process is gone
