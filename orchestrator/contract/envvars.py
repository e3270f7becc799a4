"""Names of the environment variables the two sides pass each other (and users set)."""

HOME = "ORCHESTRATE_HOME"  # the ledger's folder (login side)
LEDGER_FS = "ORCHESTRATE_LEDGER_FS"  # network|local: where the ledger is, when /proc/mounts cannot tell (login side)
SITE = "ORCHESTRATE_SITE"  # the site's defaults file (login side); empty: none
TEMPLATES = "ORCHESTRATE_TEMPLATES"  # a folder of the user's own sbatch fragments
RUN_DIR = "ORCHESTRATE_RUN_DIR"  # exported by the batch script's common fragment
SNAPSHOT_DIR = "ORCHESTRATE_SNAPSHOT_DIR"  # node-local memory for checkpoint.snapshot_every_steps (default /dev/shm)

# set by the node agent for every rank it starts
TASK_DIR = "ORCHESTRATE_TASK_DIR"
LAUNCH = "ORCHESTRATE_LAUNCH"
NODE = "ORCHESTRATE_NODE"
GENERATION = "ORCHESTRATE_GENERATION"
DEEPSPEED_CONFIG = "ORCHESTRATE_DEEPSPEED_CONFIG"  # the rendered DeepSpeed JSON (engine kind deepspeed)
RANK_STARTED = "ORCHESTRATE_RANK_STARTED"  # when a forked rank's imports began (in the node's forker): its start-up counts them
FORK_RANKS = "ORCHESTRATE_FORK_RANKS"  # 0: a node's CPU ranks start each from nothing instead of forked after one import (agent/forked.py)
TENSORBOARD_DIR = "ORCHESTRATE_TENSORBOARD_DIR"  # <task dir>/tensorboard: one folder for every launch of the task

# set by the local executor's driver for each agent it starts (SLURM's own variables otherwise)
JOB_ID = "ORCHESTRATE_JOB_ID"
RESTART_COUNT = "ORCHESTRATE_RESTART_COUNT"

# tests and benchmarks only
STRICT_TRANSITIONS = "ORCHESTRATE_STRICT_TRANSITIONS"  # 1: an illegal ledger state change raises
REQUEUE_TAKE_S = "ORCHESTRATE_REQUEUE_TAKE_S"  # seconds before a requeue that did not take is given up (default 120)
AGENT_ANSWER_S = "ORCHESTRATE_AGENT_ANSWER_S"  # seconds the node agents get to answer a hang's end record (default 60)
FAULT_INJECT = "ORCHESTRATE_FAULT_INJECT"  # the watcher dies at a named point, as a killed one would
FAULT_SLOW_SAVE_S = "ORCHESTRATE_FAULT_SLOW_SAVE_S"  # every checkpoint write takes this long more (a slow filesystem, still writing)
FAULT_STALL_SAVE = "ORCHESTRATE_FAULT_STALL_SAVE"  # the save of this step stalls for good on rank 1 in the first launch's first generation
FAULT_SLOW_STEP_S = "ORCHESTRATE_FAULT_SLOW_STEP_S"  # every optimizer step of the built-in loop takes this long more (a slow node)
FAULT_SLOW_STEPS = "ORCHESTRATE_FAULT_SLOW_STEPS"  # "S:A:B": steps A to B take S seconds more instead (a node slow for a while)
FAULT_SLOW_EVAL_S = "ORCHESTRATE_FAULT_SLOW_EVAL_S"  # every evaluation batch takes this long more
FAULT_REINIT = "ORCHESTRATE_FAULT_REINIT"  # after a resume's load, re-initialise the parameters whose names start with this
