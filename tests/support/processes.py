"""`hfplan` as a real process, for the tests that kill or interrupt it: start it, wait on files it writes,
and find every process it started (they inherit a tag in their environment, even after their parent dies)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import hfplan

TAG = "HFPLAN_TEST_RUN"
HFPLAN = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); from hfplan.cli import app; app()"


@dataclass
class Cli:
    proc: subprocess.Popen
    tag: str
    log: Path

    def output(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)


def start_cli(log: Path, *args) -> Cli:
    """`hfplan ARGS` in a new session, stdout and stderr into `log`. Ctrl-C (SIGINT) interrupts it as it does
    hfplan started from a terminal, also where the tests run as a background job (whose children inherit
    SIGINT ignored, so that a test's SIGINT would go unheard)."""
    tag = uuid.uuid4().hex
    root = str(Path(hfplan.__file__).parent.parent)
    env = os.environ | {"PYTHONPATH": root, TAG: tag, "RAY_AUTH_MODE": "disabled"}
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", HFPLAN, *map(str, args)],
                                stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Cli(proc, tag, log)


def run_cli(log: Path, *args, timeout: float = 300) -> Cli:
    return finish(start_cli(log, *args), timeout)


def finish(cli: Cli, timeout: float = 300) -> Cli:
    """Wait for a started `hfplan` to end, then kill what is left of it."""
    try:
        cli.wait(timeout)
    finally:
        stop_all(cli)
    return cli


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tagged(tag: str) -> list[int]:
    """Every live process carrying the tag (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"{TAG}={tag}".encode() in environ.split(b"\0") and state != "Z":
            found.append(int(entry))
    return found


def stop_all(cli: Cli) -> None:
    """Kill what is left of a run the test started (by pid: only processes with its tag)."""
    if cli.proc.poll() is None:
        cli.proc.kill()
        cli.proc.wait(timeout=30)
    for pid in tagged(cli.tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_for(condition: Callable[[], bool], timeout: float, what: str, cli: Cli | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if cli is not None and cli.proc.poll() is not None:
            raise AssertionError(f"hfplan exited ({cli.proc.returncode}) before {what}:\n{cli.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout} s")
        time.sleep(0.2)
