"""Library messages a user can do nothing about, dropped where they arise; nothing else is.

- bitsandbytes' CPU backend, as it is imported, tries to fetch an optional 4-bit CPU
  kernel from the Hugging Face hub through the ``kernels`` package, and logs "Failed to
  load CPU gemm_4bit_forward from kernels-community" when it cannot. peft imports
  bitsandbytes whenever it is installed (``orchestrate[qlora]``), so every LoRA run, every
  export and every warm standby logged it, though nothing was 4-bit; and a compute node
  fetches nothing from the hub (every load is ``local_files_only``), QLoRA included.
- peft 0.21 asks transformers 5.x for ``is_gradient_checkpointing``, an alias transformers
  now deprecates with a FutureWarning, once per rank: peft's call, not the user's.

Standard library only: the warm standby calls it before importing anything heavy.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

BNB_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_KERNEL_MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"
PEFT_DEPRECATION = "`is_gradient_checkpointing` is deprecated"


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def drop_bitsandbytes_kernel_warning() -> None:
    """Before peft (and so bitsandbytes) is first imported in the process; repeatable."""
    logger = logging.getLogger(BNB_CPU_LOGGER)
    if not any(isinstance(f, _DropPrefix) for f in logger.filters):
        logger.addFilter(_DropPrefix(BNB_KERNEL_MESSAGE))


@contextlib.contextmanager
def peft_deprecation_off():
    """Around peft's wrapping of a model (``get_peft_model``, ``PeftModel.from_pretrained``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=PEFT_DEPRECATION, category=FutureWarning)
        yield
