"""Compute-node side: node agent, training processes, engines. Imports only orchestrator.protocol from orchestrator."""
