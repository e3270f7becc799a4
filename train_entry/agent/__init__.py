"""The node agent: one per node and launch; it starts and supervises the ranks.

SLURM (through submitit) or the local executor starts one agent per node
(``python -m train_entry.agent TASK_DIR``, or ``submitit_entry``). The agent works out
the rendezvous point, starts ``tasks_per_node`` training processes with
torchrun-compatible variables, sends each one's output to its own log file, and ends
the launch as soon as one rank fails (the others would only hang or fail in turn).
Keeping the ranks under our own agent is what lets a later restart happen inside the
allocation without going back to the queue.

``node``: one launch, its start and node records; ``generation``: one set of ranks,
stopped and restarted in place together with the other nodes; ``ranks``: each rank's
environment and argv, and the launch's exit code from theirs; ``requeue``: back into
SLURM's queue after a save on the checkpoint signal; ``consolidation``: the job's last
step, the final checkpoint's full weights, under a timeout.
"""

from train_entry.agent.ranks import launch_exit_code, worker_env
from train_entry.agent.node import node_main, submitit_entry

__all__ = ["launch_exit_code", "node_main", "submitit_entry", "worker_env"]
