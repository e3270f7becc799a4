"""Bounds of a spec: every class of bad input the fuzzing found is an error naming its
field and line (or `--set` and the item), fast, never a traceback; and the valid forms
that used to be refused pass."""

from __future__ import annotations

import time

import pytest

from conftest import cli, write
from orchestrator.errors import SpecError
from orchestrator.spec import yamlsrc
from orchestrator.spec.load import load_spec
from orchestrator.spec.sweep import expand
from orchestrator.spec.units import parse_memory_mb, sbatch_memory

GOOD = "name: x\nsteps: 10\n"


def issues_of(tmp_path, text, overrides=()):
    """The issues of a spec text; the loader must refuse it with a bounded amount of work
    (this process's CPU seconds: a busy machine's wall clock would measure the machine)."""
    path = write(tmp_path / "s.yaml", text)
    start = time.process_time()
    with pytest.raises(SpecError) as exc:
        spec, raw, lines = load_spec(path, list(overrides))
        expand(spec, raw, lines, str(path))
    assert time.process_time() - start < 5, "bounded input must be refused quickly"
    return exc.value.issues


def one_issue(tmp_path, text, overrides=()):
    (issue,) = issues_of(tmp_path, text, overrides)
    return issue


def loads(tmp_path, text, overrides=()):
    path = write(tmp_path / "ok.yaml", text)
    spec, raw, lines = load_spec(path, list(overrides))
    expand(spec, raw, lines, str(path))
    return spec


# ------------------------------------------------------------------ YAML bounds


def test_a_spec_file_over_the_size_cap_is_refused_unread(tmp_path):
    issue = one_issue(tmp_path, GOOD + "#" * (yamlsrc.MAX_BYTES + 1) + "\n")
    assert "larger than 1048576 bytes (1 MiB)" in issue.message and issue.source.endswith("s.yaml")


def test_deep_nesting_is_refused_at_its_line(tmp_path):
    issue = one_issue(tmp_path, GOOD + "model:\n  kwargs: " + "[" * 100_000 + "]" * 100_000 + "\n")
    assert issue.line == 4 and f"nested more than {yamlsrc.MAX_DEPTH} levels deep" in issue.message
    issue = one_issue(tmp_path, GOOD + "x: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n")
    assert issue.line == 3 and "nested more than" in issue.message


def test_an_alias_bomb_is_refused_before_it_expands(tmp_path):
    lols = "a: &a [" + ", ".join(["lol"] * 10) + "]\n"
    lols += "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    issue = one_issue(tmp_path, GOOD + lols)
    assert f"more than {yamlsrc.MAX_NODES} values (aliases expanded)" in issue.message and issue.line is not None


def test_a_recursive_alias_is_refused_with_its_line(tmp_path):
    issue = one_issue(tmp_path, GOOD + "model:\n  kwargs:\n    x: &a [1, *a]\n")
    assert issue.line == 5 and "alias *a is inside its own anchor &a: a recursive structure" in issue.message
    issue = one_issue(tmp_path, GOOD + "x: &m {<<: *m}\n")
    assert "recursive structure" in issue.message


def test_a_long_chain_of_merge_keys_is_bounded(tmp_path):
    chain = "x0: &x0 {a: 1}\n" + "".join(f"x{i}: &x{i} {{<<: *x{i - 1}, b{i}: 1}}\n" for i in range(1, 3000))
    issue = one_issue(tmp_path, GOOD + chain)
    assert "more than" in issue.message or "nested too deeply" in issue.message


def test_aliases_within_bounds_still_work_and_are_copies(tmp_path):
    spec = loads(tmp_path, GOOD + "sweep:\n  points:\n    - &p {seed: 1}\n    - *p\n", ["sweep.points=[{seed: 1}, {seed: 2}]"])
    assert [p["seed"] for p in spec.sweep.points] == [1, 2]
    data, _ = yamlsrc.load_with_lines("a: &a {x: 1}\nb: *a\n", "t")
    assert data["a"] == data["b"] and data["a"] is not data["b"]  # setting a.x never changes b.x


@pytest.mark.parametrize("char", ["\x00", "\x07", "\x1b", "\x7f", "\x9b"])
def test_non_printable_characters_are_refused_with_their_line(tmp_path, char):
    issue = one_issue(tmp_path, GOOD + f"env:\n  A: 'a{char}b'\n")
    assert issue.line == 4 and f"U+{ord(char):04X}" in issue.message and "not allowed" in issue.message


def test_non_printable_characters_written_as_escapes_are_refused_at_their_field(tmp_path):
    issue = one_issue(tmp_path, GOOD + 'model: {kind: script, script: "a\\0b"}\n')
    assert (issue.path, issue.line) == ("model.script", 3) and "U+0000" in issue.message
    issue = one_issue(tmp_path, GOOD + 'env:\n  "A\\x01": b\n')
    assert issue.line == 4 and "U+0001" in issue.message


def test_integers_past_the_digit_cap_are_refused_not_parsed(tmp_path):
    for literal in ("1" + "0" * 5000, "0x" + "f" * 5000, "-" + "9" * 31):
        issue = one_issue(tmp_path, GOOD + f"seed: {literal}\n")
        assert issue.line == 3 and f"at most {yamlsrc.MAX_INT_DIGITS}" in issue.message


def test_binary_data_has_no_place_in_a_spec(tmp_path):
    issue = one_issue(tmp_path, GOOD + "model: {kind: entrypoint, entrypoint: 'a:b', kwargs: {x: !!binary AAAA}}\n")
    assert issue.line == 3 and "!!binary" in issue.message


def test_numbers_follow_yaml_1_2_where_yaml_1_1_surprises(tmp_path):
    spec = loads(tmp_path, GOOD + "optimizer: {lr: 1e-3, weight_decay: 1E-2}\nresources: {time: 1:30:00}\n")
    assert spec.optimizer.lr == 1e-3 and spec.optimizer.weight_decay == 0.01
    assert spec.resources.time == "1:30:00" and spec.resources.time_seconds == 5400  # not the base-60 int 5400


# ------------------------------------------------------------------ --set


@pytest.mark.parametrize(
    "item, path, words",
    [
        ("resources.nodes=many", "resources.nodes", "valid integer"),
        ("steps=true", "steps", "valid integer"),
        ("model=&a [*a]", "model", "recursive structure"),
        ("seed=1" + "0" * 5000, "seed", f"at most {yamlsrc.MAX_INT_DIGITS}"),
        ("env.A=a\x01b", "env.A", "U+0001"),
        ('env.A="a\\x1bb"', "env.A", "U+001B"),
        ("model.kwargs=" + "[" * 40 + "]" * 40, "model.kwargs", "nested more than"),
        ("a..b=1", "a..b", "empty field name"),
        ("=1", "", "not of the form key.path=value"),
        ("steps.x=1", "steps.x", "'steps' is 10, not a mapping"),
        ("sweep.points.0.seed=1", "sweep.points.0.seed", "a list"),
        ("a." * 40 + "b=1", "", "at most 31"),
        ("optimizer.lr=.inf", "optimizer.lr", "finite number"),
        ("model.kind=hf", "model.path", "required field is missing"),
        ("engine={kind: deepspeed, config: {zero_optimization: 5}}", "engine.config.zero_optimization", "engine.stage"),
    ],
)
def test_set_errors_name_set_and_the_item_never_a_line(tmp_path, item, path, words):
    text = GOOD + "sweep:\n  points:\n    - {seed: 1}\n"
    issues = issues_of(tmp_path, text, [item])
    issue = next((i for i in issues if i.path == path), None)
    assert issue is not None, [i.render() for i in issues]
    assert issue.source == "--set" and issue.line is None, issue.render()
    assert words in issue.message and "--set " in issue.message, issue.message


def test_set_items_that_conflict_are_an_error_naming_both(tmp_path):
    for items in (["model.n_layer=2", "model=4"], ["model=4", "model.n_layer=2"]):
        issues = issues_of(tmp_path, GOOD, items)
        assert any(i.source == "--set" and "conflicts with --set 'model" in i.message for i in issues), issues
    spec = loads(tmp_path, GOOD, ["seed=1", "seed=2"])  # the same field twice: the last wins
    assert spec.seed == 2


def test_a_swept_value_from_set_is_blamed_on_set(tmp_path):
    issue = one_issue(tmp_path, GOOD + "sweep:\n  grid:\n    seed: [1, 2]\n", ["sweep.grid.seed=[1, x]"])
    assert issue.source == "--set" and issue.line is None and issue.path == "seed" and "sweep task 1" in issue.message


def test_a_bad_sweep_value_in_the_file_names_its_grid_line(tmp_path):
    issues = issues_of(tmp_path, GOOD + "sweep:\n  grid:\n    optimizer.lr: [0.1, -1]\n    seed: [1, 2]\n")
    assert len(issues) == 2  # the two tasks with lr -1
    for issue in issues:
        assert issue.line == 5 and issue.path == "optimizer.lr" and "greater than 0" in issue.message


def test_problems_found_before_queueing_name_set_too(tmp_path):
    from orchestrator.submit.submission import make_plan

    spec = write(tmp_path / "s.yaml", GOOD + f"model: {{kind: hf, path: {tmp_path}}}\ndata: {{kind: jsonl, path: nope.jsonl}}\n")
    with pytest.raises(SpecError) as exc:
        make_plan(str(spec), ["model.path=/nonexistent-model"], "local", tmp_path)
    issues = {i.path: i for i in exc.value.issues}
    assert issues["model.path"].source == "--set" and issues["model.path"].line is None
    assert "(from --set 'model.path=/nonexistent-model')" in issues["model.path"].message
    assert issues["data.path"].line == 4  # the file's own value keeps its line


def test_cli_names_set_without_a_traceback(tmp_path, home):
    spec = write(tmp_path / "s.yaml", GOOD)
    out = cli("validate", str(spec), "--set", "resources.nodes=1e30", home=home)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--set: resources.nodes: Input should be a valid integer" in out.stderr
    assert "(from --set 'resources.nodes=1e30')" in out.stderr and "s.yaml:" not in out.stderr
    out = cli("validate", str(spec), "--set", "model=&a [*a]", home=home)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "--set: model: value refused" in out.stderr


# ------------------------------------------------------------------ numeric fields


@pytest.mark.parametrize(
    "text, path, words",
    [
        ("resources: {nodes: 1.0e30}", "resources.nodes", "valid integer"),
        ("resources: {nodes: 100001}", "resources.nodes", "less than or equal to 100000"),
        ("resources: {tasks_per_node: 1025}", "resources.tasks_per_node", "less than or equal to 1024"),
        ("resources: {cpus_per_task: 4097}", "resources.cpus_per_task", "less than or equal to 4096"),
        ("resources: {gpus_per_task: true}", "resources.gpus_per_task", "valid integer"),
        ("resources: {time: '400-00:00:00'}", "resources.time", "more than 365 days"),
        ("resources: {time: '9999999999'}", "resources.time", "not a SLURM time limit"),
        ("resources: {mem: 2000T}", "resources.mem", "more than 1P"),
        ("resources: {mem: '" + "9" * 5000 + "'}", "resources.mem", "not a memory size"),
        ("resources: {gpu_memory: '0'}", "resources.gpu_memory", "leave gpu_memory out"),
        ("steps: true", "steps", "valid integer"),
        ("steps: 2.0", "steps", "valid integer"),
        ("steps: 1000000000001", "steps", "less than or equal to 1000000000000"),
        ("seed: -1", "seed", "greater than or equal to 0"),
        ("seed: 4294967296", "seed", "less than or equal to 4294967295"),
        ("optimizer: {lr: .inf}", "optimizer.lr", "finite number"),
        ("optimizer: {lr: .nan}", "optimizer.lr", "finite number"),
        ("optimizer: {lr: 1.0e+300}", "optimizer.lr", "less than or equal to 100"),
        ("optimizer: {lr: true}", "optimizer.lr", "valid number"),
        ("optimizer: {betas: [1.5, 0.9]}", "optimizer.betas", "[0, 1)"),
        ("optimizer: {betas: [true, 0.9]}", "optimizer.betas", "two numbers"),
        ("optimizer: {betas: [.nan, 0.9]}", "optimizer.betas[0]", "finite number"),
        ("optimizer: {grad_clip: 1.0e+30}", "optimizer.grad_clip", "less than or equal to"),
        ("schedule: {warmup_steps: 1.0e+20}", "schedule.warmup_steps", "valid integer"),
        ("batch: {micro_batch_size: 2097152}", "batch.micro_batch_size", "less than or equal to 1048576"),
        ("heartbeat: {interval_s: .inf}", "heartbeat.interval_s", "finite number"),
        ("heartbeat: {interval_s: 86401}", "heartbeat.interval_s", "less than or equal to 86400"),
        ("heartbeat: {timeout_s: 1.0e+9}", "heartbeat.timeout_s", "less than or equal to 86400"),
        ("retry: {max_restarts: 10001}", "retry.max_restarts", "less than or equal to 10000"),
        ("retry: {max_requeues: true}", "retry.max_requeues", "valid integer"),
        ("retry: {backoff_s: 1.0e+9}", "retry.backoff_s", "less than or equal to 86400"),
        ("checkpoint: {every_steps: true}", "checkpoint.every_steps", "whole number of steps"),
        ("checkpoint: {every_steps: often}", "checkpoint.every_steps", "whole number of steps from 1 to 1,000,000,000,000, or auto"),
        ("checkpoint: {every_steps: auto, every_minutes: 5}", "checkpoint", "every_minutes is what every_steps: auto chooses"),
        ("checkpoint: {every_steps: auto, auto_min_minutes: 9, auto_max_minutes: 3}", "checkpoint", "auto_min_minutes (9) is above"),
        ("checkpoint: {signal_before_s: 70000}", "checkpoint.signal_before_s", "less than or equal to 65535"),
        ("checkpoint: {keep_last: 10001}", "checkpoint.keep_last", "less than or equal to 10000"),
        ("checkpoint: {every_minutes: .inf}", "checkpoint.every_minutes", "finite number"),
        ("checkpoint: {consolidate: {max_shard_size: '" + "9" * 400 + "GB'}}", "checkpoint.consolidate.max_shard_size", "not a size"),
        ("checkpoint: {consolidate: {max_shard_size: 2PB}}", "checkpoint.consolidate.max_shard_size", "not a size"),
        ("checkpoint: {consolidate: {max_shard_size: 10B}}", "checkpoint.consolidate.max_shard_size", "outside 1KB..1TB"),
        ("checkpoint: {consolidate: {timeout_min: .inf}}", "checkpoint.consolidate.timeout_min", "finite number"),
        ("logging: {every_steps: 0}", "logging.every_steps", "greater than or equal to 1"),
        ("model: {n_head: true}", "model.n_head", "valid integer"),
        ("model: {d_model: 1048576}", "model.d_model", "less than or equal to 65536"),
        ("model: {dropout: .nan}", "model.dropout", "finite number"),
        ("data: {seed: -1}", "data.seed", "greater than or equal to 0"),
        ("data: {num_tokens: 1000000000000}", "data.num_tokens", "less than or equal to"),
        ("batch: {micro_batch_size: 1048576, grad_accum: 1048576}\nresources: {nodes: 2}", "batch.micro_batch_size", "at most 1099511627776"),
        ("engine: {kind: deepspeed, stage: true}", "engine.stage", "valid integer"),
        ("sweep: {max_parallel: 100000}", "sweep.max_parallel", "less than or equal to 10000"),
        ("sweep: {max_parallel: true}", "sweep.max_parallel", "valid integer"),
        ("resources: {time: '00:01:00'}", "checkpoint.signal_before_s", "before the task starts"),
        ("checkpoint: {snapshot_every_steps: 5}\nresources: {nodes: 2}", "checkpoint.snapshot_every_steps", "has 2 nodes"),
        ("checkpoint: {snapshot_every_steps: 0}", "checkpoint.snapshot_every_steps", "greater than or equal to 1"),
    ],
)
def test_numbers_out_of_range_name_the_field(tmp_path, text, path, words):
    issue = one_issue(tmp_path, ("name: x\n" if text.startswith("steps:") else GOOD) + text + "\n")
    assert issue.path == path and words in issue.message, issue.render()
    assert issue.line is not None


@pytest.mark.parametrize(
    "text, path",
    [
        ("model: {kind: script, script: ''}", "model.script"),
        ("data: {kind: text, path: ''}", "data.path"),
        ("engine: {kind: deepspeed, stage: 3, offload_param: nvme, nvme_path: ''}", "engine.nvme_path"),
        ("engine: {kind: fsdp, wrap: ['']}", "engine.wrap[0]"),
        ("checkpoint: {resume_from: ''}", "checkpoint.resume_from"),
        ("env: {'': x}", "env."),
        ("env: {'A=B': x}", "env.A=B"),
        ("sweep: {grid: {'optimizer..lr': [1]}}", "sweep.grid"),
        ("sweep: {points: [{'': 1}]}", "sweep.points"),
    ],
)
def test_empty_names_are_refused(tmp_path, text, path):
    issue = one_issue(tmp_path, GOOD + text + "\n")
    assert issue.path == path, issue.render()


def test_forms_that_were_refused_are_valid(tmp_path):
    spec = loads(
        tmp_path,
        GOOD + "resources: {time: 90, mem: 4096}\nenv: {OMP_NUM_THREADS: 4}\noptimizer: {lr: 1, grad_clip: 2}\n"
        "checkpoint: {consolidate: {max_shard_size: 1048576}}\n",
    )
    assert spec.resources.time_seconds == 90 * 60 and parse_memory_mb(spec.resources.mem) == 4096
    assert spec.env == {"OMP_NUM_THREADS": "4"} and spec.optimizer.lr == 1.0
    assert spec.checkpoint.consolidate.max_shard_size == "1048576"
    issue = one_issue(tmp_path, GOOD + "env: {A: true}\n")  # true is not the text "true": quote it
    assert issue.path == "env.A"


# ------------------------------------------------------------------ mem: 0


def test_mem_0_is_all_of_the_nodes_memory_not_1_mb(tmp_path):
    assert parse_memory_mb("0") == 0 and parse_memory_mb("0G") == 0 and parse_memory_mb("1K") == 1
    assert sbatch_memory("0") == "0" and sbatch_memory("16G") == "16384M"
    spec = loads(tmp_path, GOOD + "resources: {mem: '0'}\n")
    assert parse_memory_mb(spec.resources.mem) == 0
    spec = loads(tmp_path, GOOD + "resources: {mem: 0}\n")  # unquoted: the same
    assert spec.resources.mem == "0"


def test_mem_0_reaches_sbatch_as_0(tmp_path):
    from orchestrator.scheduler.slurm_script import batch_parameters
    from orchestrator.submit.submission import make_plan

    plan = make_plan(str(write(tmp_path / "s.yaml", GOOD + "resources: {mem: '0'}\n")), [], "slurm", tmp_path)
    mem = batch_parameters(plan)["additional_parameters"]["mem"]
    assert mem in ("0", "0M")  # both are SLURM's "all of it" (0 MB is the special value, never 1 MB)


def test_the_memory_plan_takes_0_as_unknown(tmp_path):
    from orchestrator.submit.memory_inputs import setting_of

    spec = loads(tmp_path, GOOD + "resources: {mem: '0', gpu_memory: 80G}\n")
    assert setting_of(spec).gpu_memory == 80 * 1024**3
    assert setting_of(spec, gpu_memory=0).gpu_memory is None  # no recommendation, figures only


def test_plan_refuses_a_gpu_of_0_memory_and_absurd_sizes(tmp_path, home):
    spec = write(tmp_path / "s.yaml", GOOD)
    for args, words in ((["--gpu-memory", "0"], "--gpu-memory: a GPU has more than 0 memory"), (["--nodes", "1000000"], "--nodes must be 1 to 100000")):
        out = cli("plan", str(spec), *args, home=home)
        assert out.returncode == 2 and words in out.stderr and "Traceback" not in out.stderr, out.stderr


# ------------------------------------------------------------------ DeepSpeed keys the spec owns

DS = GOOD + "engine:\n  kind: deepspeed\n  config: {config}\n"


@pytest.mark.parametrize(
    "config, path, field",
    [
        ("{zero_optimization: 5}", "engine.config.zero_optimization", "engine.stage"),
        ("{zero_optimization: [1]}", "engine.config.zero_optimization", "engine.stage"),
        ("{zero_optimization: {stage: 3}}", "engine.config.zero_optimization.stage", "engine.stage"),
        ("{zero_optimization: {offload_optimizer: {device: cpu}}}", "engine.config.zero_optimization.offload_optimizer.device", "engine.offload_optimizer"),
        ("{zero_optimization: {offload_param: none}}", "engine.config.zero_optimization.offload_param", "engine.offload_param"),
        ("{zero_optimization: {cpu_offload: true}}", "engine.config.zero_optimization.cpu_offload", "engine.offload_optimizer"),
        ("{'zero_optimization.stage': 3}", "engine.config.zero_optimization.stage", "engine.stage"),
        ("{fp16: 5}", "engine.config.fp16", "engine.precision"),
        ("{fp16: {enabled: true}}", "engine.config.fp16.enabled", "engine.precision"),
        ("{bf16: {enabled: true}}", "engine.config.bf16.enabled", "engine.precision"),
        ("{bfloat16: {enabled: true}}", "engine.config.bfloat16.enabled", "engine.precision"),
        ("{train_batch_size: 8}", "engine.config.train_batch_size", "batch.global_batch_size"),
        ("{train_micro_batch_size_per_gpu: 8}", "engine.config.train_micro_batch_size_per_gpu", "batch.micro_batch_size"),
        ("{gradient_accumulation_steps: 8}", "engine.config.gradient_accumulation_steps", "batch.grad_accum"),
        ("{gradient_clipping: 1.0}", "engine.config.gradient_clipping", "optimizer.grad_clip"),
        ("{optimizer: {type: Adam}}", "engine.config.optimizer.type", "optimizer"),
        ("{scheduler: null}", "engine.config.scheduler", "schedule"),
        ("{activation_checkpointing: {partition_activations: true}}", "engine.config.activation_checkpointing.partition_activations", "engine.activation_checkpointing"),
    ],
)
def test_owned_deepspeed_keys_are_refused_at_every_depth(tmp_path, config, path, field):
    issue = one_issue(tmp_path, DS.replace("{config}", config))
    assert issue.path == path and f"`{field}`" in issue.message and issue.line == 5, issue.render()


@pytest.mark.parametrize(
    "config, words",
    [
        ("{'zero_optimization.reduce_bucket_size': 5}", "nested mappings, not dotted keys"),
        ("{zero_optimization: {reduce_bucket_size: .inf}}", "not a finite number"),
    ],
)
def test_other_config_mistakes_name_the_key(tmp_path, config, words):
    issue = one_issue(tmp_path, DS.replace("{config}", config))
    assert issue.path.startswith("engine.config.") and words in issue.message, issue.render()


def test_tuning_keys_pass_and_reach_the_config(tmp_path):
    from orchestrator.submit import deepspeed_config

    spec = loads(tmp_path, DS.replace("{config}", "{zero_optimization: {reduce_bucket_size: 5e8}, fp16: {loss_scale: 0}, zero_allow_untested_optimizer: true, steps_per_print: 10}"))
    cfg = deepspeed_config.render(spec)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 5e8 and cfg["zero_optimization"]["stage"] == 2
    assert cfg["steps_per_print"] == 10 and cfg["fp16"] == {**cfg["fp16"], "loss_scale": 0, "enabled": False}


# ------------------------------------------------------------------ sweeps


def test_a_huge_sweep_is_refused_before_it_is_expanded(tmp_path):
    grid = ", ".join(str(i) for i in range(100))
    text = GOOD + f"sweep:\n  grid:\n    seed: [{grid}]\n    schedule.warmup_steps: [{grid}]\n    logging.every_steps: [{grid[3:]}]\n"
    start = time.process_time()
    issue = one_issue(tmp_path, text)
    assert time.process_time() - start < 2
    assert issue.path == "sweep" and issue.line == 3 and "tasks (100 x 100 x 99)" in issue.message
    assert "at most 10000" in issue.message and "split the sweep over several specs" in issue.message


def test_a_grid_of_a_million_values_is_refused_by_the_loader(tmp_path):
    issue = one_issue(tmp_path, GOOD + "sweep:\n  grid:\n    seed: [" + ",".join(["1"] * 1_000_000)[: yamlsrc.MAX_BYTES - 100] + "]\n")
    assert f"more than {yamlsrc.MAX_NODES} values" in issue.message


def test_swept_keys_that_conflict_or_cross_a_non_mapping_are_refused(tmp_path):
    issue = one_issue(tmp_path, GOOD + "sweep:\n  grid:\n    model: [{n_layer: 2}]\n  points:\n    - {model.n_layer: 3}\n")
    assert "is inside 'model'" in issue.message and issue.line == 7
    issue = one_issue(tmp_path, GOOD + "sweep:\n  grid:\n    steps.x: [1]\n")
    assert "'steps' is 10, not a mapping" in issue.message and issue.line == 5
