"""Notifications (spec ``notify``): ledger events a person wants to hear of, POSTed to a
webhook by the watcher.

``triggers`` decides which events are worth a message (pure), ``outbox`` keeps them in
the ledger until delivered (the watcher's thread, the ledger's only writer), and
``webhook`` sends them from one background thread that never touches the ledger.
"""
