"""Compute-node side: node agent, training processes, engines, consolidation. Imports
nothing from orchestrator but the standard-library contract, ``orchestrator.contract``."""
