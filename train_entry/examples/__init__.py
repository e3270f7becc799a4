"""Example entry points (``model: {kind: entrypoint, entrypoint: train_entry.examples.<module>:build}``)."""
