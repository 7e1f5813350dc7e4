"""Shared test helpers: running the CLI in-process, checking one-line user errors, time limits."""

from __future__ import annotations

import contextlib
import signal

from typer.testing import CliRunner

from hfplan import cli


def invoke(*args):
    return CliRunner().invoke(cli.app, [str(a) for a in args])


def assert_user_error(result, *needles) -> str:
    """Exit code 2, nothing on stdout, one line on stderr starting with 'error: ' and holding every needle."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@contextlib.contextmanager
def deadline(seconds: int):
    """Raise TimeoutError in the test if the block runs longer than `seconds` (SIGALRM; main thread)."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
