"""The contract between the login side (orchestrator) and compute nodes (train_entry).

Standard library only: ``train_entry`` imports this package and nothing else from
``orchestrator``. It fixes the run folder layout and every file name in it
(``layout``), the environment variables the two sides pass (``envvars``), atomic
writes and safe reads (``files``), the records compute nodes write (``records``,
``generations``), the checkpoint on disk (``checkpoint``), the typed task
configuration (``taskconfig``), exit codes and failure kinds (``codes``), and the SLURM
host list syntax both sides parse (``hostlist``).

Everything public is also importable from the package itself (``contract.ExitCode``).
"""

from . import envvars
from .checkpoint import (
    CHECKPOINT_FORMAT,
    MANIFEST,
    checkpoint_name,
    checkpoint_tmp,
    commit_checkpoint,
    committed_checkpoints,
    discard_checkpoint,
    file_sha256,
    remove_leftovers,
    verify_checkpoint,
)
from .codes import EXIT_OF_KIND, UNCAUGHT_EXCEPTION, ExitCode, FailureKind, RequeueCause, TextEnum, failure_kind
from .files import (
    append_jsonl,
    atomic_write_json,
    atomic_write_text,
    create_exclusive_json,
    fsync_dir,
    read_json,
    read_jsonl_from,
)
from .generations import DUMP_SIGNAL_OFFSET, GenerationAction, dump_signal, generation_end, generation_ends
from .hostlist import expand_hostlist
from .layout import (
    DEEPSPEED_CONFIG,
    ERROR_GLOB,
    NODE_RECORD_GLOB,
    SPEC_RESOLVED,
    TASK_CONFIG,
    UNRESPONSIVE_GLOB,
    cancel_flag_path,
    checkpoints_dir,
    deepspeed_config_path,
    derive_port,
    error_path,
    events_path,
    generation_dumped_path,
    generation_end_path,
    generation_stopped_path,
    heartbeat_dir,
    heartbeat_path,
    launch_dir,
    launch_key,
    launches_dir,
    log_path,
    metrics_path,
    node_record_path,
    requeue_path,
    stacks_path,
    start_path,
    step_error_path,
    task_config_path,
    task_dir,
    unresponsive_path,
    weights_dir,
)
from .records import CONTRACT_VERSION, heartbeat_record
from .taskconfig import TaskConfig, TaskConfigError
