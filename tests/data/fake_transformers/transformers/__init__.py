"""A stand-in for transformers' import structure in the bootstrap's tests: the package
imports ``transformers.trainer`` lazily, on first use of ``Trainer``, as the real one does."""

import importlib


class TrainerCallback:
    pass


def __getattr__(name):
    if name == "Trainer":
        return importlib.import_module(".trainer", __name__).Trainer
    raise AttributeError(name)
