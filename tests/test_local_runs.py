"""Runs on a Ray of their own (hfplan's local start, no --address), as `hfplan execute` processes: what such a
run listens on beyond loopback, and Ctrl-C stops every process of it and says how to resume.

What listens: only Ray's processes (their gRPC servers bind every interface whatever the node address; torch's
rendezvous store runs inside a Ray worker) and the driver (the CLI), as the README's security section says. The
test cannot tell the store from Ray's own servers inside a worker process: it fails on a listener of any other
of the runs' processes, not on one of those.

Both Ctrl-C tests' runs start together (a module fixture), and the listening test reads them before they are
interrupted: much of such a run's start is waiting (Ray's start-up, its processes' polls, the rendezvous), which
the two runs overlap."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from hfplan.executor.resume import latest
from tests.support.executor_runs import cpu_plan, tiny_workload
from tests.support.processes import Cli, start_cli, stop_all, tagged, wait_for

pytestmark = pytest.mark.slow

LISTEN = "0A"


def listening() -> set[tuple[str, int, str]]:
    """(address, port, socket inode) of every listening TCP socket of this machine (/proc/net/tcp, tcp6)."""
    found = set()
    for name, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            address, port = fields[1].split(":")
            found.add((_address(address, width), int(port, 16), fields[9]))
    return found


def _address(hex_address: str, width: int) -> str:
    if width == 8:
        return ".".join(str(int(hex_address[i:i + 2], 16)) for i in (6, 4, 2, 0))
    return "::1" if hex_address == "0" * 24 + "01000000" else f"ipv6:{hex_address}"


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


def owners(pids) -> dict[str, str]:
    """Socket inode -> the command line of the process holding it, for the processes `pids`."""
    found = {}
    for pid in pids:
        try:
            command = command_line(pid)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    found[target[8:-1]] = command
        except OSError:
            continue
    return found


# Processes allowed to listen beyond loopback, each named in the README: Ray's own, and the driver (Ray's core
# worker in it), here the `hfplan execute` process (torch's TCP store is in set rank 0 workers: ray:: processes).
RAY_PROCESSES = ("raylet", "gcs_server", "ray::", "ray/dashboard", "ray/_private", "ray/autoscaler")


@pytest.fixture(scope="module")
def local_runs(tmp_path_factory):
    """Two runs of many iterations, a checkpoint after each, each on a Ray of its own, started together; keyed by
    whether the Ctrl-C test that stops it sends SIGINT to the process group."""
    plan_file = tmp_path_factory.mktemp("plan") / "plan.json"
    plan_file.write_text(cpu_plan(tiny_workload("ppo"), [(("actor", "critic", "reference"), 2)]).to_json())
    runs: dict[bool, tuple[Cli, Path]] = {}
    try:
        for to_group in (False, True):
            folder = tmp_path_factory.mktemp("local-run")
            runs[to_group] = (start_cli(folder / "log", "execute", plan_file, "--out", folder / "run", "--iterations",
                                        200, "--checkpoint-every", 1), folder / "run")
        yield runs
    finally:
        for cli, _ in runs.values():
            stop_all(cli)


def wait_first_checkpoint(cli: Cli, out: Path) -> None:
    wait_for(lambda: latest(out) is not None, 300, "first checkpoint", cli)


def test_a_local_run_listens_on_loopback_only(local_runs):
    """Once both runs have checkpointed an iteration (their workers up, their groups met): the sockets of their
    processes (all carry their run's tag: other processes of this machine are not the runs')."""
    for cli, out in local_runs.values():
        wait_first_checkpoint(cli, out)
    held = owners({pid for cli, _ in local_runs.values() for pid in tagged(cli.tag)})
    wide = {(address, port): held[inode] for address, port, inode in listening()
            if inode in held and not is_loopback(address)}
    drivers = {command_line(cli.proc.pid) for cli, _ in local_runs.values()}
    unexpected = {key: who for key, who in wide.items()
                  if not any(name in who for name in RAY_PROCESSES) and who not in drivers}
    assert not unexpected, unexpected


@pytest.mark.parametrize("to_group", [False, True], ids=["to the CLI", "to its process group, as a terminal does"])
def test_ctrl_c_stops_every_process_and_says_how_to_resume(local_runs, to_group):
    """Its processes, Ray's too, carry the run's tag."""
    cli, out = local_runs[to_group]
    try:
        wait_first_checkpoint(cli, out)
        assert len(tagged(cli.tag)) > 3  # the CLI, Ray's own processes and the two workers
        (os.killpg if to_group else os.kill)(cli.proc.pid, signal.SIGINT)
        code = cli.wait(60)
        wait_for(lambda: not tagged(cli.tag), 30, "end of every process of the run")
    finally:
        stop_all(cli)
    output = cli.output()
    assert code == 130, output
    hint = next(line for line in output.splitlines() if line.startswith("interrupted"))
    assert f"--out {out} --resume" in hint, hint
    assert str(latest(out).parent) in hint
