"""The evaluation of one committed checkpoint, off the training path (issue 33).

The checkpoint is checked and exported to a Hugging Face folder (the consolidation every
``ckpt consolidate`` runs), the model is loaded from it, and the evaluation runs:

- ``generate``: a JSONL of prompts with references; greedy answers up to a token limit;
  metrics ``exact_match``, ``contains``, and a user function ``module:function`` that
  scores one answer (``prompts``, ``generate``);
- ``lm-eval``: the lm-eval harness on the export, for tasks from local files (``harness``);
- ``command``: the user's program, given the export, writes a JSON of metrics (``program``);

or the base model itself, as step 0. As a SLURM job, submitit calls ``job.run`` on the node.

Its result (``contract.records.EVAL_RESULT``) is written last, atomically, to
``evals/step-N/result.json`` in the task folder: a result that is there is complete.

    python -m train_entry.checkpoint_eval CHECKPOINT --prompts heldout.jsonl [--out DIR]
    python -m train_entry.checkpoint_eval CHECKPOINT --kind lm-eval --task T --include-path DIR
"""

from train_entry.checkpoint_eval.prompts import EvalError, Prompt, read_prompts
from train_entry.checkpoint_eval.run import Settings, evaluate_checkpoint

__all__ = ["EvalError", "Prompt", "Settings", "evaluate_checkpoint", "read_prompts"]
