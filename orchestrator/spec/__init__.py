"""The experiment spec. Models: ``experiment`` (the whole `Spec`) built from ``workload``
(model, data), ``engines``, ``sections`` (resources, batch, optimizer), ``policies`` (checkpoint, retry,
heartbeat, logging, notify) on the
base in ``strict``. Loading: ``load`` (YAML with line numbers via ``yamlsrc``, `--set`
overrides), ``issues`` (errors pointed at the user's text), ``layers`` (site and user
defaults under the spec, and where each value came from) with ``defaults`` (their
files). Also sweep expansion (``sweep``), SLURM units (``units``), the generated
field reference (``reference``), and the compute side's section dataclasses generated
from the models (``contractgen``), both guided by the markers beside fields (``scope``)."""
