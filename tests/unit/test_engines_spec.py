"""Engine options and batch arithmetic in the spec, and the DeepSpeed config made from them."""

import json

import pytest

from conftest import cli, write
from orchestrator.submit import deepspeed_config
from orchestrator.errors import SpecError
from orchestrator.spec.load import load_spec


def issues_of(tmp_path, text):
    with pytest.raises(SpecError) as exc:
        load_spec(write(tmp_path / "s.yaml", text))
    return [(i.path, i.line, i.message) for i in exc.value.issues]


def test_batch_numbers_that_do_not_add_up_name_the_field_and_the_sum(tmp_path):
    head = "name: x\nsteps: 1\nresources: {nodes: 2, tasks_per_node: 2}\n"
    ((path, line, msg),) = issues_of(tmp_path, head + "batch:\n  micro_batch_size: 8\n  grad_accum: 2\n  global_batch_size: 100\n")
    assert (path, line) == ("batch.global_batch_size", 7)
    assert "100 != micro_batch_size x grad_accum x world size = 8 x 2 x 4 = 64" in msg
    ((path, _, msg),) = issues_of(tmp_path, head + "batch: {micro_batch_size: 8, global_batch_size: 100}\n")
    assert path == "batch.global_batch_size" and "not a multiple of micro_batch_size x world size = 8 x 4 = 32" in msg
    spec, _, _ = load_spec(write(tmp_path / "ok.yaml", head + "batch: {micro_batch_size: 8, global_batch_size: 128}\n"))
    assert (spec.batch.grad_accum, spec.batch.global_batch_size) == (4, 128)  # derived
    spec, _, _ = load_spec(write(tmp_path / "ok2.yaml", head))
    assert (spec.batch.grad_accum, spec.batch.global_batch_size) == (1, 32)


@pytest.mark.parametrize(
    "engine, path, words",
    [
        ("{kind: ddp, precision: fp16}", "engine.precision", "only engine kind `deepspeed`"),
        ("{kind: fsdp, precision: fp16}", "engine.precision", "use bf16"),
        ("{kind: fsdp, stage: 2}", "engine.stage", "valid keys: activation_checkpointing, backend, cpu_offload"),
        ("{kind: ddp, cpu_offload: true}", "engine.cpu_offload", "unknown key"),
        ("{kind: deepspeed, stage: 2, offload_param: cpu}", "engine.offload_param", "needs stage 3 (this is stage 2)"),
        ("{kind: deepspeed, stage: 0, offload_optimizer: cpu}", "engine.offload_optimizer", "needs stage 1, 2 or 3"),
        ("{kind: deepspeed, stage: 3, offload_param: nvme}", "engine.nvme_path", "a fast local folder"),
        ("{kind: deepspeed, stage: 4}", "engine.stage", "less than or equal to 3"),
        ("{kind: deepspeed, template: huge}", "engine.template", "available: large-model, zero"),
        ("{kind: deepspeed, config: {train_batch_size: 64}}", "engine.config.train_batch_size", "use `batch.global_batch_size`"),
        ("{kind: deepspeed, config: {zero_optimization: {stage: 3}}}", "engine.config.zero_optimization.stage", "use `engine.stage`"),
        ("{kind: fsdp, sharding: hybrid}", "engine.sharding", "with resources.nodes: 1 use `full`"),
        ("{kind: deepspeed, precision: fp16}", "engine.precision", "fp16 runs on GPUs only"),
    ],
)
def test_options_the_engine_does_not_have_are_rejected_naming_the_field(tmp_path, engine, path, words):
    ((p, line, msg),) = issues_of(tmp_path, f"name: x\nsteps: 1\nengine: {engine}\n")
    assert p == path and line == 3 and words in msg, (p, msg)


def test_validate_command_rejects_them_with_exit_2(tmp_path, home):
    spec = write(tmp_path / "s.yaml", "name: x\nsteps: 1\nengine:\n  kind: deepspeed\n  stage: 1\n  offload_param: cpu\n")
    out = cli("validate", str(spec), home=home)
    assert out.returncode == 2 and "s.yaml:6: engine.offload_param: parameter offload needs stage 3" in out.stderr
    assert "Traceback" not in out.stderr


def test_deepspeed_config_is_template_then_spec_then_overrides(tmp_path):
    spec, _, _ = load_spec(
        write(
            tmp_path / "s.yaml",
            "name: x\nsteps: 1\nresources: {nodes: 2, tasks_per_node: 4, gpus_per_task: 1}\n"
            "batch: {micro_batch_size: 2, global_batch_size: 64}\noptimizer: {grad_clip: 0.5}\n"
            "engine:\n  kind: deepspeed\n  stage: 3\n  precision: bf16\n  offload_optimizer: cpu\n"
            "  config: {zero_optimization: {reduce_bucket_size: 1000}, wall_clock_breakdown: true}\n",
        )
    )
    cfg = deepspeed_config.render(spec)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (64, 2, 4)
    assert cfg["gradient_clipping"] == 0.5 and cfg["bf16"] == {"enabled": True} and cfg["fp16"]["enabled"] is False
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert z["reduce_bucket_size"] == 1000 and z["overlap_comm"] is True and cfg["wall_clock_breakdown"] is True
    # DeepSpeed's own models accept what we render
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert DeepSpeedZeroConfig(**z).stage == 3


def test_the_rendered_config_is_saved_in_the_run_folder(tmp_path, home):
    spec = write(tmp_path / "s.yaml", "name: x\nsteps: 1\nengine: {kind: deepspeed, stage: 1}\nsweep: {grid: {engine.stage: [1, 2]}}\n")
    from orchestrator.submit import submission
    plan = submission.make_plan(str(spec), [], "local", home)
    submission.write_run_folder(plan)
    stages = [json.loads((t.task_dir / "deepspeed.json").read_text())["zero_optimization"]["stage"] for t in plan.tasks]
    assert stages == [1, 2]
