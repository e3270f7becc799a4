"""Installed as the package ``orchestrator.templates`` (pyproject.toml's package-dir):
DeepSpeed config templates (``deepspeed/*.json``) and batch-script fragments
(``sbatch/*.sh``), found with importlib.resources. A regular package on purpose: as a
namespace package, ``importlib.resources.files`` gives a MultiplexedPath, not a path."""
