"""From a validated spec to submitted jobs: the plan (no side effects; the type is the
scheduler's, ``scheduler.request``), the DeepSpeed config it renders, the memory
planner, and ``submission`` (the one step with side effects: run folder, ledger rows,
scheduler)."""
