"""The contract between the login side (orchestrator) and compute nodes (train_entry).

Standard library only: ``train_entry`` imports this package and nothing else from
``orchestrator``. It fixes the run folder layout and every file name in it
(``layout``), the environment variables the two sides pass (``envvars``), atomic
writes and safe reads (``files``), the records compute nodes write (``records``,
``generations``), the checkpoint on disk (``checkpoint``), the typed task
configuration (``taskconfig``), exit codes and failure kinds (``codes``), a full or
failing filesystem as both sides tell it (``storage``), and the SLURM host list syntax
both sides parse (``hostlist``).

Everything public is also importable from the package itself (``contract.ExitCode``).
"""

from . import envvars
from .checkpoint import (
    CHECKPOINT_FORMAT,
    HF_EXPORT,
    MANIFEST,
    STEP_PREFIX,
    TMP_PREFIX,
    TRASH_PREFIX,
    ManifestError,
    UnsafeDeletion,
    check_member,
    checkpoint_name,
    checkpoint_tmp,
    commit_checkpoint,
    committed_checkpoints,
    deletion_problem,
    discard_checkpoint,
    remove_trash,
    file_sha256,
    read_manifest,
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
    GENERATION_END_GLOB,
    HEARTBEAT_GLOB,
    NODE_RECORD_GLOB,
    SPEC_RESOLVED,
    SPEC_SOURCES,
    TASK_CONFIG,
    UNRESPONSIVE_GLOB,
    cancel_flag_path,
    fault_rate_path,
    checkpoints_dir,
    consolidate_log_path,
    deepspeed_config_path,
    derive_port,
    error_path,
    events_path,
    generation_dumped_path,
    data_handoff_path,
    generation_end_path,
    generation_stopped_path,
    EVAL_ERROR,
    EVAL_RESULT,
    eval_dir,
    eval_error_path,
    eval_result_path,
    heartbeat_dir,
    heartbeat_path,
    launch_dir,
    launch_key,
    launches_dir,
    log_path,
    metrics_path,
    node_record_path,
    requeue_path,
    stacks_dir,
    stacks_path,
    start_path,
    step_error_path,
    task_config_path,
    task_dir,
    unresponsive_path,
    weights_dir,
    weights_tmp_dir,
)
from .pins import pins_path, read_pins, unseen_after, write_pins, write_seen
from .records import CONTRACT_VERSION, Phase, RequeueBy, heartbeat_record
from .snapshots import discard_snapshots, private_snapshot_root, snapshot_root

# The task configuration's thirty dataclasses cost ~10 ms to build; read-only commands
# (status, events) never touch them, so they are imported on first use.
_LAZY = {"TaskConfig", "TaskConfigError", "thaw"}


def __getattr__(name: str):
    if name in _LAZY:
        from . import taskconfig

        return getattr(taskconfig, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHECKPOINT_FORMAT",
    "CONTRACT_VERSION",
    "DEEPSPEED_CONFIG",
    "DUMP_SIGNAL_OFFSET",
    "ERROR_GLOB",
    "GENERATION_END_GLOB",
    "HEARTBEAT_GLOB",
    "EXIT_OF_KIND",
    "ExitCode",
    "FailureKind",
    "GenerationAction",
    "HF_EXPORT",
    "ManifestError",
    "MANIFEST",
    "STEP_PREFIX",
    "TMP_PREFIX",
    "TRASH_PREFIX",
    "NODE_RECORD_GLOB",
    "Phase",
    "RequeueBy",
    "RequeueCause",
    "SPEC_RESOLVED",
    "SPEC_SOURCES",
    "TASK_CONFIG",
    "TaskConfig",
    "TaskConfigError",
    "TextEnum",
    "UNCAUGHT_EXCEPTION",
    "UNRESPONSIVE_GLOB",
    "UnsafeDeletion",
    "append_jsonl",
    "atomic_write_json",
    "atomic_write_text",
    "cancel_flag_path",
    "fault_rate_path",
    "check_member",
    "checkpoint_name",
    "pins_path",
    "read_pins",
    "unseen_after",
    "write_seen",
    "write_pins",
    "checkpoint_tmp",
    "checkpoints_dir",
    "consolidate_log_path",
    "commit_checkpoint",
    "committed_checkpoints",
    "create_exclusive_json",
    "deepspeed_config_path",
    "deletion_problem",
    "derive_port",
    "discard_checkpoint",
    "discard_snapshots",
    "remove_trash",
    "dump_signal",
    "envvars",
    "error_path",
    "events_path",
    "expand_hostlist",
    "failure_kind",
    "file_sha256",
    "fsync_dir",
    "generation_dumped_path",
    "generation_end",
    "data_handoff_path",
    "generation_end_path",
    "generation_ends",
    "generation_stopped_path",
    "EVAL_ERROR",
    "EVAL_RESULT",
    "eval_dir",
    "eval_error_path",
    "eval_result_path",
    "heartbeat_dir",
    "heartbeat_path",
    "heartbeat_record",
    "launch_dir",
    "launch_key",
    "launches_dir",
    "log_path",
    "metrics_path",
    "node_record_path",
    "read_json",
    "read_manifest",
    "read_jsonl_from",
    "private_snapshot_root",
    "remove_leftovers",
    "snapshot_root",
    "requeue_path",
    "stacks_dir",
    "stacks_path",
    "start_path",
    "step_error_path",
    "task_config_path",
    "task_dir",
    "thaw",
    "unresponsive_path",
    "verify_checkpoint",
    "weights_dir",
    "weights_tmp_dir",
]
