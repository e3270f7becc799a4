"""validate, schema, plan: the commands that read a spec and submit nothing."""

from __future__ import annotations

import json

from orchestrator.cli import render
from orchestrator.cli.console import stdout_console
from orchestrator.errors import UserError
from orchestrator.ledger import access
from orchestrator.spec.units import parse_memory_mb
from orchestrator.submit import memory_inputs, memory_plan
from orchestrator.submit import submission


def cmd_validate(args) -> int:
    home = access.home_dir(args.home)
    plan = submission.make_plan(args.spec, args.overrides, "local", home, purpose="validate")
    print(f"{args.spec}: valid, {len(plan.tasks)} task(s), world size {plan.resources.world_size} each")
    for note in plan.skipped:
        print(f"  not checked: {note}")
    if args.explain:
        stdout_console().print(render.sources_table(plan.sources))
    return 0


def cmd_schema(args) -> int:
    from orchestrator.spec.experiment import Spec

    if args.markdown:
        from orchestrator.spec.reference import markdown_reference

        print(markdown_reference())
    else:
        print(json.dumps(Spec.model_json_schema(), indent=2))
    return 0


def cmd_plan(args) -> int:
    home = access.home_dir(args.home)
    plan = submission.make_plan(args.spec, args.overrides, "local", home, purpose="plan")
    tasks = {t.index: t for t in plan.tasks}
    if args.task not in tasks:
        raise UserError(f"--task {args.task}: the sweep has tasks 0..{len(tasks) - 1}")
    for flag, value, most in (("--nodes", args.nodes, 100_000), ("--gpus-per-node", args.gpus_per_node, 1024)):
        if value is not None and not 1 <= value <= most:  # the spec's bounds of resources.nodes, tasks_per_node
            raise UserError(f"{flag} must be 1 to {most}")
    try:
        gpu_memory = parse_memory_mb(args.gpu_memory) * 1024**2 if args.gpu_memory else None
    except ValueError as exc:
        raise UserError(f"--gpu-memory: {exc}") from None
    if gpu_memory == 0:
        raise UserError("--gpu-memory: a GPU has more than 0 memory; leave the option out when unknown")
    spec = tasks[args.task].spec
    setting = memory_inputs.setting_of(spec, args.nodes, args.gpus_per_node, gpu_memory)
    doc = memory_plan.plan(memory_inputs.shape_of(spec), setting)
    doc["spec_engine"] = memory_inputs.candidate_of(spec.engine)
    doc["not_checked"] = list(plan.skipped)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        stdout_console().print(*render.memory_plan_tables(doc))
        for note in plan.skipped:
            print(f"not checked: {note}")
    return 0
