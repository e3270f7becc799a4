# GPU nodes: NCCL reports errors instead of hanging, and says why it failed.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-0}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
