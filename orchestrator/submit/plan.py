"""Spec -> submission plan (``scheduler.request.Plan``, what the scheduler takes):
everything that will be written and submitted. No side effects: it reads only the
DeepSpeed templates; ``submission`` writes and submits."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator import contract
from orchestrator.scheduler.request import Plan, PlannedTask
from orchestrator.spec.experiment import Spec
from orchestrator.spec.sweep import TaskSpec
from orchestrator.spec.units import parse_bytes
from orchestrator.submit import deepspeed_config


def build_plan(spec: Spec, tasks: list[TaskSpec], *, experiment_id: str, executor: str, spec_path: str, workdir: Path) -> Plan:
    run_dir = workdir / f"{spec.name}-{experiment_id}"
    planned = []
    for t in tasks:
        tdir = contract.task_dir(run_dir, t.index)
        config = t.spec.model_dump(mode="json")
        config.pop("sweep", None)
        config.update(
            contract=contract.CONTRACT_VERSION,
            experiment_id=experiment_id,
            index=t.index,
            params=t.params,
            task_dir=str(tdir),
        )
        if t.spec.checkpoint.consolidate is not None:
            config["checkpoint"]["consolidate"]["max_shard_bytes"] = parse_bytes(t.spec.checkpoint.consolidate.max_shard_size)
        if t.spec.engine.kind == "deepspeed":
            config["deepspeed_config"] = deepspeed_config.render(t.spec)
        planned.append(PlannedTask(t.index, t.params, tdir, contract.TaskConfig.from_dict(config), t.spec))
    return Plan(
        experiment_id=experiment_id,
        name=spec.name,
        executor=executor,
        spec_path=spec_path,
        run_dir=run_dir,
        resources=spec.resources,
        max_parallel=spec.sweep.max_parallel,
        spec=spec,
        tasks=planned,
    )


def render_plan_text(plan: Plan) -> str:
    s = plan.summary()
    per = s["per_task"]
    lines = [
        f"experiment {plan.name} ({plan.experiment_id}) -> {plan.executor} executor",
        f"run folder  {plan.run_dir}",
        f"tasks       {len(plan.tasks)}" + (f", at most {plan.max_parallel} at once" if plan.max_parallel else ""),
        f"each task   {per['nodes']} node(s) x {per['ranks_per_node']} rank(s) = world size {per['world_size']}, "
        f"{per['cpus_per_rank']} CPU(s) and {per['gpus_per_rank']} GPU(s) per rank, time limit {per['time']}",
    ]
    for t in plan.tasks:
        lines.append(f"  task {t.index}: {json.dumps(t.params, sort_keys=True) if t.params else '(no sweep parameters)'}")
    return "\n".join(lines)
