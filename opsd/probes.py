"""Liveness of a role process: what its GET /livez answers (readiness, GET /readyz, is `opsd.service.RoleProcess`'s).

Live means progressing, not merely answering HTTP: the role's work loop beat
within `probes.beat_s`, or it is inside a guarded call (an engine generate, a
PPO update, a weights load) that has not yet run past that call's own limit.
A guard that overruns its limit, or a loop that falls silent outside any
guard, makes the role not live, and Kubernetes restarts it. So only a hang
may do that, never slow work: the limits are sized for real GPUs
(opsd.config.ProbesSection), and waits for things outside the process (Redis
coming back, room downstream, a step's groups) beat while they wait, since a
restart cannot hurry them.

Before the loop's first beat (the model loading) the process counts as live:
startup is the startup probe's, which waits on /readyz, and Kubernetes runs no
liveness probe before it passes. A guard overrunning its limit counts then too.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class Liveness:
    """Beats of a role's work loop and the guarded long calls running now; safe to use from any thread.

    beat_s: seconds the loop may go without a beat while no guarded call
    runs (> 0). clock: seconds, monotonic (tests may pass their own).
    Raises ValueError for beat_s <= 0.
    """

    def __init__(self, beat_s: float, clock: Callable[[], float] = time.monotonic):
        if not beat_s > 0:
            raise ValueError(f"beat_s must be > 0, got {beat_s}")
        self.beat_s = beat_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None  # None until the loop first beats
        self._calls: dict[int, tuple[str, float, float]] = {}  # guard -> (name, started at, limit_s)
        self._ids = itertools.count()

    def beat(self) -> None:
        """The loop made progress now."""
        with self._lock:
            self._last = self._clock()

    @contextlib.contextmanager
    def guard(self, name: str, limit_s: float) -> Iterator[None]:
        """Run the body as a guarded call: not live once it has run more than `limit_s` seconds.

        Guards may nest and run in many threads at once; while any is open the
        loop's silence is not held against the role (the call has its own
        limit). Leaving the body, even by an exception, is a beat once the loop
        has started. Raises ValueError for limit_s <= 0.
        """
        if not limit_s > 0:
            raise ValueError(f"limit_s must be > 0, got {limit_s}")
        with self._lock:
            key = next(self._ids)
            self._calls[key] = (name, self._clock(), limit_s)
        try:
            yield
        finally:
            with self._lock:
                del self._calls[key]
                if self._last is not None:
                    self._last = self._clock()

    def state(self) -> dict[str, Any]:
        """What /livez answers: {"live": bool, "reason": str | None, "since_beat_s": float | None,
        "calls": [{"name", "running_s", "limit_s"}, ...]} (seconds; reason None while live)."""
        now = self._clock()
        with self._lock:
            calls = [{"name": name, "running_s": round(now - t0, 3), "limit_s": limit}
                     for name, t0, limit in self._calls.values()]
            since = None if self._last is None else now - self._last
        over = [c for c in calls if c["running_s"] > c["limit_s"]]
        reason = None
        if over:
            worst = max(over, key=lambda c: c["running_s"] - c["limit_s"])
            reason = f"{worst['name']} has run {worst['running_s']:.0f} s, past its limit of {worst['limit_s']:g} s"
        elif not calls and since is not None and since > self.beat_s:
            reason = f"the work loop has not beaten for {since:.0f} s (limit probes.beat_s = {self.beat_s:g} s)"
        return {"live": reason is None, "reason": reason,
                "since_beat_s": None if since is None else round(since, 3), "calls": calls}
