import os

import pytest

from orchestrator import contract
from orchestrator.spec.units import format_slurm_time, parse_memory_mb, parse_slurm_time


@pytest.mark.parametrize(
    "text,expected",
    [
        ("n1", ["n1"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[1-2,5],gpu[08-10]", ["n1", "n2", "n5", "gpu08", "gpu09", "gpu10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a,b", ["a", "b"]),
    ],
)
def test_expand_hostlist(text, expected):
    assert contract.expand_hostlist(text) == expected


def test_slurm_units():
    assert parse_slurm_time("90") == 5400
    assert parse_slurm_time("1:30") == 90
    assert parse_slurm_time("01:00:00") == 3600
    assert parse_slurm_time("2-00:00:00") == 172800
    assert parse_slurm_time("1-2") == 93600
    with pytest.raises(ValueError):
        parse_slurm_time("1h")
    assert format_slurm_time(93784) == "1-02:03:04"
    assert parse_memory_mb("4G") == 4096 and parse_memory_mb("500M") == 500 and parse_memory_mb("1024") == 1024


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    target = tmp_path / "sub" / "hb.json"
    contract.atomic_write_json(target, {"a": 1})
    contract.atomic_write_json(target, {"a": 2})
    assert contract.read_json(target) == {"a": 2}
    assert os.listdir(target.parent) == ["hb.json"]
    assert contract.read_json(tmp_path / "absent.json") is None


def test_jsonl_reader_takes_only_complete_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    contract.append_jsonl(p, {"step": 1})
    with open(p, "a") as fh:
        fh.write('{"step": 2')  # a writer caught mid-line
    rows, off = contract.read_jsonl_from(p, 0)
    assert rows == [{"step": 1}]
    with open(p, "a") as fh:
        fh.write("}\n")
    rows, off2 = contract.read_jsonl_from(p, off)
    assert rows == [{"step": 2}] and off2 == p.stat().st_size


def test_ports_differ_between_jobs_and_generations():
    ports = {contract.derive_port(str(j)) for j in range(1000, 1100)}
    assert len(ports) == 100 and all(20000 <= p < 32000 for p in ports)  # below the kernel's ephemeral ports
    assert contract.derive_port("1234_5") != contract.derive_port("1234_5", generation=1)
    # a requeued job keeps its id and may land on the same node: its restarts get other ports too
    tries = {contract.derive_port("1234_5", generation=g, restart=r) for g in range(4) for r in range(4)}
    assert len(tries) == 16


def test_the_tools_run_by_hand_shard_as_the_spec_does_by_default():
    """`python -m train_entry.consolidate` and the checkpoint evaluation's export, run without
    a spec, write shards of the size `checkpoint.consolidate` defaults to."""
    from orchestrator.contract.sections import Consolidate
    from orchestrator.spec.policies import Consolidate as SpecConsolidate
    from orchestrator.spec.units import parse_bytes

    assert contract.MAX_SHARD_BYTES == Consolidate.max_shard_bytes == parse_bytes(SpecConsolidate().max_shard_size)


def test_contract_sections_are_generated_from_the_current_spec():
    """The compute side's section dataclasses are the spec's fields, written once in the spec:
    regenerate with scripts/regen-contract-sections after changing one."""
    import dataclasses

    from conftest import REPO
    from orchestrator.contract import sections as tc
    from orchestrator.contract.taskconfig import TaskConfig
    from orchestrator.spec import hf as spec_hf
    from orchestrator.spec import policies, sections
    from orchestrator.spec.contractgen import TARGET, render

    assert (REPO / TARGET).read_text() == render(), "regenerate with scripts/regen-contract-sections"
    # every section of task.json is a field of TaskConfig, of its class
    declared = {f.name: f.type for f in dataclasses.fields(TaskConfig)}
    assert {name: declared.get(name) for name in tc.SECTIONS} == {name: cls.__name__ for name, cls in tc.SECTIONS.items()}
    pairs = {
        tc.Resources: sections.Resources, tc.Optimizer: sections.Optimizer, tc.Schedule: sections.Schedule,
        tc.Batch: sections.Batch, tc.Logging: policies.Logging, tc.Checkpoint: policies.Checkpoint,
        tc.Retry: policies.Retry, tc.Heartbeat: policies.Heartbeat, tc.Consolidate: policies.Consolidate, tc.Eval: spec_hf.Eval,
    }
    checked = 0
    for ours, theirs in pairs.items():
        for f in dataclasses.fields(ours):
            if f.name in ("max_shard_bytes", "grad_accum"):
                continue  # computed by the planner; resolved from null before task.json is written
            default = theirs.model_fields[f.name].get_default(call_default_factory=True)
            assert f.default == default, f"{ours.__name__}.{f.name}: {f.default!r} != spec {default!r}"
            checked += 1
    assert checked >= 40
    assert tc.Batch().grad_accum == 1 and tc.Consolidate().max_shard_bytes == 5 << 30
    # what only the compute side reads crosses; the login side's fields stay behind
    assert [f.name for f in dataclasses.fields(tc.Resources)] == [
        "nodes", "tasks_per_node", "cpus_per_task", "gpus_per_task", "share_with_group"]
    assert "global_batch_size" not in {f.name for f in dataclasses.fields(tc.Batch)}


def test_task_config_round_trips_what_the_planner_writes(tmp_path):
    from orchestrator.contract import TaskConfig, TaskConfigError
    from orchestrator.spec.load import load_spec
    from orchestrator.spec.sweep import expand
    from orchestrator.submit.plan import build_plan

    path = tmp_path / "s.yaml"
    path.write_text("name: t\nsteps: 5\nengine: {kind: deepspeed, stage: 3}\ncheckpoint: {consolidate: {dtype: bf16}}\n")
    spec, raw, lines = load_spec(str(path), [])
    plan = build_plan(spec, expand(spec, raw, lines, str(path)), experiment_id="x", executor="local", spec_path=str(path), workdir=tmp_path)
    cfg = plan.tasks[0].config
    assert isinstance(cfg, TaskConfig)
    again = TaskConfig.from_dict(cfg.to_dict())
    assert again == cfg
    assert cfg.engine["stage"] == 3 and cfg.deepspeed_config["zero_optimization"]["stage"] == 3
    assert cfg.checkpoint.consolidate.dtype == "bf16" and cfg.checkpoint.consolidate.max_shard_bytes == 5 << 30
    assert cfg.retry.max_restarts == 3 and cfg.batch.grad_accum == 1
    with pytest.raises(TaskConfigError, match="contract version"):
        TaskConfig.from_dict({**cfg.to_dict(), "contract": 99})
    with pytest.raises(TaskConfigError, match="retry: expected a mapping"):
        TaskConfig.from_dict({**cfg.to_dict(), "retry": 5})
    with pytest.raises(TaskConfigError, match="no field 'steps'"):
        TaskConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "steps"})
    # the spec holds more than the compute side reads (resources.partition...): taken as ours, the rest left
    wider = TaskConfig.from_dict({**cfg.to_dict(), "resources": {"tasks_per_node": 4, "partition": "gpu"}, "workdir": "/x"})
    assert wider.resources.tasks_per_node == 4 and not hasattr(wider.resources, "partition")
    assert cfg["steps"] == 5 and cfg["retry"]["max_restarts"] == 3  # dict-style access, as the client API gave

