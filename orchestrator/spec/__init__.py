"""The experiment spec: pydantic models (``model``), YAML loading with line numbers
(``yamlsrc``), sweep expansion (``sweep``), SLURM units (``units``) and the generated
field reference (``reference``)."""
