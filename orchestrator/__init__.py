"""orchestrate: SLURM batch orchestration and fault tolerance for distributed fine-tuning."""

__version__ = "0.1.0"
