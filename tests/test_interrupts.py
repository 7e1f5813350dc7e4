"""The run's Ctrl-C latch: a SIGINT that a library caught still stops the run at the controller's next check."""

import os
import signal

import pytest

from hfplan.executor.interrupts import InterruptLatch


@pytest.fixture(autouse=True)
def _terminal_sigint():
    """Python's own SIGINT handler, as in a terminal's foreground job; a pytest started in the background of a
    shell inherits SIGINT ignored, and the latch rightly leaves that alone."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _sigint_that_a_library_swallows() -> None:
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # Python runs the handler between bytecodes
            pass
    except KeyboardInterrupt:
        pass


def test_a_swallowed_sigint_is_raised_again_by_check():
    with InterruptLatch() as latch:
        latch.check()  # nothing came yet
        _sigint_that_a_library_swallows()
        assert latch.received
        with pytest.raises(KeyboardInterrupt):
            latch.check()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigint_still_raises_where_it_comes():
    with InterruptLatch(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):
            pass


def test_a_handler_of_the_process_own_is_left_alone():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with InterruptLatch() as latch:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
            latch.check()
        assert seen == [signal.SIGINT] and not latch.received
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)
