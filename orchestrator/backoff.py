"""How long to wait before trying again: exponential backoff, with jitter unless told.
Below both of its users, the recovery policy (``supervise.recovery``) and the
notification outbox's retries (``notify.outbox``)."""

from __future__ import annotations

import tenacity


def backoff_s(recovery_number: int, initial: float, maximum: float, jitter: bool = True) -> float:
    """Delay before the ``recovery_number``-th recovery (or retry) may start: exponential,
    with jitter unless told (tenacity's strategy, so many tasks failing at once do not come
    back at once)."""
    if initial <= 0:
        return 0.0
    state = tenacity.RetryCallState(None, None, (), {})
    state.attempt_number = max(1, recovery_number)
    wait = tenacity.wait_exponential(multiplier=initial, max=maximum)
    if jitter:
        wait = wait + tenacity.wait_random(0, initial / 4)
    return float(min(maximum, wait(state)))
