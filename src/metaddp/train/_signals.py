"""Stop requests by signal: SIGTERM (a scheduler's preemption) and SIGINT (Ctrl-C) are noted,
not obeyed at once, so that the training loop can end its step, checkpoint and exit cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


# A Ctrl-C reaches a launched process twice: from the terminal (its process group) and
# passed on by the launcher, a few milliseconds apart. A second SIGINT within this many seconds
# of the first is that same request, not a second one.
SAME_REQUEST_S = 2.0


class StopSignals:
    """Inside the block, SIGTERM and SIGINT set :attr:`received` (the signal's name) instead of
    ending the process; a second SIGINT ends it at once, unless ``escalate`` is false (a
    process whose launcher escalates itself) or it comes within :data:`SAME_REQUEST_S` of the
    first. Outside the main thread, where handlers cannot be installed, it does nothing.

    Python runs a signal handler between bytecodes, so a handler waits for the torch
    operation in progress (a whole backward pass is one); two presses during one long backward
    would then look like one request. So the signals are also written, as they arrive, to a
    wake-up pipe (``signal.set_wakeup_fd``) that a small thread reads: it times them, and on a
    second request calls ``on_second`` (which says what the folder keeps) and ends the process
    with status 130. Checkpoints are written whole or not at all, so the last one stays.

    Args:
        escalate: a second SIGINT ends the process (else it is noted like the first).
        on_second: called on the watcher thread before the process ends (print a line).
    """

    def __init__(self, escalate: bool = True, on_second: Callable[[], None] | None = None) -> None:
        self.received: str | None = None
        self.escalate = escalate
        self.on_second = on_second
        self._first = 0.0
        self._saved: dict[int, Any] = {}
        self._pipe: tuple[int, int] | None = None
        self._wakeup = -1
        self._watcher: threading.Thread | None = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self._first = signal.Signals(signum).name, now
        elif signum == signal.SIGINT and self.escalate and now - self._first > SAME_REQUEST_S:
            raise KeyboardInterrupt

    def _watch(self, fd: int) -> None:
        first: float | None = None
        while True:
            try:
                got = os.read(fd, 64)
            except OSError:
                return
            if not got:
                return  # the block ended: the pipe was closed
            for signum in got:
                if signum not in (signal.SIGINT, signal.SIGTERM):
                    continue
                now = time.monotonic()
                if first is None:
                    first = now
                elif signum == signal.SIGINT and self.escalate and now - first > SAME_REQUEST_S:
                    if self.on_second is not None:
                        with contextlib.suppress(Exception):
                            self.on_second()
                    os._exit(EXIT_INTERRUPTED)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._saved[s] = signal.signal(s, self._handle)
            if self.escalate:
                r, w = os.pipe()
                os.set_blocking(w, False)
                self._pipe = (r, w)
                self._wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
                self._watcher = threading.Thread(target=self._watch, args=(r,), daemon=True)
                self._watcher.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._pipe is not None:
            signal.set_wakeup_fd(self._wakeup)
            r, w = self._pipe
            os.close(w)  # the watcher reads the end of the pipe and returns
            if self._watcher is not None:
                self._watcher.join(timeout=5)
            os.close(r)
            self._pipe, self._watcher = None, None
        for s, handler in self._saved.items():
            signal.signal(s, handler)
        self._saved = {}


EXIT_INTERRUPTED = 130  # as a shell reports a process ended by SIGINT
