"""The ``orchestrate`` command: argument parsing (``main``), one module per command
group, and the terminal renderers (``render``)."""
