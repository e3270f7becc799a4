"""The ``orchestrate`` command: the entry point and dispatch (``main``), the grammar
(``parser``), one module per command group, imported only when its command runs, and
the terminal renderers (``render``, ``console``)."""
