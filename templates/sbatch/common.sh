# Always included; orchestrate fills in the double-braced names, each as one quoted shell word.
export PYTHONUNBUFFERED=1
export ORCHESTRATE_RUN_DIR={{run_dir}}
printf 'orchestrate: %s (%s) job %s array task %s restart %s on %s at %s\n' {{name}} {{experiment_id}} \
  "${SLURM_JOB_ID}" "${SLURM_ARRAY_TASK_ID:-none}" "${SLURM_RESTART_COUNT:-0}" "${SLURM_JOB_NODELIST}" "$(date -Is)"
