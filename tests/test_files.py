"""Output files: refused before any work when they cannot be written (folders, devices, /proc, missing or
unwritable folders), symlinks followed to their target, and several outputs written all or nothing."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hfplan.errors import HfplanError
from hfplan.files import check_writable, write_atomically, write_outputs


def test_a_folder_is_refused(tmp_path):
    with pytest.raises(HfplanError, match="it is a folder"):
        check_writable(tmp_path, "--out")
    with pytest.raises(HfplanError, match="it is a folder"):
        write_atomically(tmp_path, "x")
    assert list(tmp_path.iterdir()) == []


def test_a_missing_folder_is_refused(tmp_path):
    with pytest.raises(HfplanError, match="--csv .*folder .* does not exist"):
        check_writable(tmp_path / "nowhere" / "all.csv", "--csv")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
def test_a_device_is_never_replaced():
    before = os.stat("/dev/full")
    with pytest.raises(HfplanError, match="not a regular file"):
        check_writable(Path("/dev/full"), "--out")
    with pytest.raises(HfplanError, match="not a regular file"):
        write_atomically("/dev/full", "x")
    after = os.stat("/dev/full")
    assert stat.S_ISCHR(after.st_mode) and after.st_ino == before.st_ino


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc")
def test_proc_is_refused_with_the_reason():
    for path in (Path("/proc/self/plan.json"), Path("/proc/plan.json")):
        with pytest.raises(HfplanError, match=f"cannot write --out {path}: "):
            check_writable(path, "--out")
        with pytest.raises(HfplanError, match=f"cannot write {path}: "):
            write_atomically(path, "x")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_unwritable_folder_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with pytest.raises(HfplanError, match="Permission denied"):
            check_writable(folder / "best.json", "--out")
    finally:
        folder.chmod(0o755)


def test_a_symlink_is_followed_to_its_target(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "plan.json"
    target.write_text("old\n")
    link = tmp_path / "best.json"
    link.symlink_to(target)
    check_writable(link, "--out")
    write_atomically(link, "new\n")
    assert link.is_symlink() and link.resolve() == target
    assert target.read_text() == "new\n"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["plan.json"]  # no temporary file left


def test_a_dangling_symlink_creates_its_target(tmp_path):
    target = tmp_path / "made.json"
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_atomically(link, "x")
    assert link.is_symlink() and target.read_text() == "x"


def test_outputs_are_written_all_or_nothing(tmp_path):
    first, second = tmp_path / "best.json", tmp_path / "all.csv"
    first.write_text("previous plan\n")
    with pytest.raises(TypeError):
        write_outputs([(first, "new plan\n"), (second, 123)])  # the second cannot be written at all
    assert first.read_text() == "previous plan\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.json"]
    with pytest.raises(HfplanError, match="it is a folder"):
        write_outputs([(first, "new plan\n"), (tmp_path, "x")])
    assert first.read_text() == "previous plan\n"
    write_outputs([(first, "new plan\n"), (second, b"a,b\n")])
    assert first.read_text() == "new plan\n" and second.read_bytes() == b"a,b\n"


def test_two_outputs_naming_one_file_are_refused(tmp_path):
    with pytest.raises(HfplanError, match="same file"):
        write_outputs([(tmp_path / "x.json", "a"), (tmp_path / "." / "x.json", "b")])
    assert list(tmp_path.iterdir()) == []
