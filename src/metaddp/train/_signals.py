"""Stop requests by signal: SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) are noted,
not obeyed at once, so that the training loop can end its step, checkpoint and exit cleanly."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Inside the block, SIGTERM and SIGINT set :attr:`received` (the signal's name) instead of
    ending the process; a second SIGINT raises ``KeyboardInterrupt`` as usual. Outside the
    main thread, where handlers cannot be installed, it does nothing."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._saved: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = self.received or signal.Signals(signum).name

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
