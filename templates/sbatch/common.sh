# Always included; orchestrate fills in the double-braced names.
export PYTHONUNBUFFERED=1
export ORCHESTRATE_RUN_DIR={{run_dir}}
echo "orchestrate: {{name}} ({{experiment_id}}) job ${SLURM_JOB_ID} array task ${SLURM_ARRAY_TASK_ID:-none} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST} at $(date -Is)"
