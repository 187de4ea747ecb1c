"""Stop requests by signal: SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) are noted,
not obeyed at once, so that the training loop can end its step, checkpoint and exit cleanly."""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


# A Ctrl-C reaches a launched process twice: from the terminal (its process group) and
# passed on by the launcher, a few milliseconds apart. A second SIGINT within this many seconds
# of the first is that same request, not a second one.
SAME_REQUEST_S = 2.0


class StopSignals:
    """Inside the block, SIGTERM and SIGINT set :attr:`received` (the signal's name) instead of
    ending the process; a second SIGINT raises ``KeyboardInterrupt`` as usual, unless
    ``escalate`` is false (a process whose launcher escalates itself) or it comes within
    :data:`SAME_REQUEST_S` of the first. Outside the main thread, where handlers cannot be
    installed, it does nothing."""

    def __init__(self, escalate: bool = True) -> None:
        self.received: str | None = None
        self.escalate = escalate
        self._first = 0.0
        self._saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._first = signal.Signals(signum).name, now
        elif signum == signal.SIGINT and self.escalate and now - self._first > SAME_REQUEST_S:
            raise KeyboardInterrupt

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._saved[s] = signal.signal(s, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for s, handler in self._saved.items():
            signal.signal(s, handler)
        self._saved = {}
