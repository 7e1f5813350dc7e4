"""Ctrl-C that stops a run even where a library catches it.

Ray's core worker checks for signals while it waits (starting up, connecting, fetching) and may turn the
KeyboardInterrupt into a status it retries on; the run then goes on as if nothing happened. The latch remembers
every SIGINT, so the controller raises it again at its next check."""

from __future__ import annotations

import signal
import threading
from types import FrameType


class InterruptLatch:
    """SIGINT raises KeyboardInterrupt as usual and is also remembered until the block ends; `check()` raises it
    again. Outside the main thread, or where the process has a SIGINT handler of its own, it changes nothing."""

    def __init__(self) -> None:
        self.received = False
        self._installed = False

    def __enter__(self) -> InterruptLatch:
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            signal.signal(signal.SIGINT, self._remember)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._installed = False

    def _remember(self, signum: int, frame: FrameType | None) -> None:
        self.received = True
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise KeyboardInterrupt if a SIGINT came during the block, whoever caught it then."""
        if self.received:
            raise KeyboardInterrupt
