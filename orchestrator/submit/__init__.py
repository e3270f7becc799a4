"""From a validated spec to submitted jobs: the plan (no side effects), the DeepSpeed config and
sbatch fragments it renders, the memory planner, and ``submission`` (the one step
with side effects: run folder, ledger rows, scheduler)."""
