"""The run folder as the login side reads it back: the records compute nodes leave,
read through ``contract.safe_read`` with what was skipped kept as problems
(``badrecords``), and each launch's records as one ``LaunchRecord`` (``launches``).
Below both the supervision that acts on them and the report that shows them."""
