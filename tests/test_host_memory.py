"""A CPU worker's peak memory leaves out the shared pages it maps (Ray's object store)."""

from __future__ import annotations

from hfplan.executor.host_memory import peak_resident_bytes

STATUS = """Name:\tray::SetWorker
VmPeak:\t 2100000 kB
VmHWM:\t  955392 kB
VmRSS:\t  950000 kB
RssAnon:\t  640000 kB
RssFile:\t  170000 kB
RssShmem:\t  136192 kB
"""


def test_the_peak_is_the_resident_peak_less_the_shared_pages():
    assert peak_resident_bytes(STATUS) == (955392 - 136192) * 1024


def test_a_status_without_shared_pages_counts_the_whole_peak():
    assert peak_resident_bytes("VmHWM:\t 1024 kB\n") == 1024 * 1024


def test_this_process_peak_is_at_least_what_it_holds_now():
    held = bytearray(64 << 20)  # touched: resident
    held[::4096] = b"\x01" * len(held[::4096])
    assert peak_resident_bytes() >= len(held)


def test_without_the_kernels_status_it_is_the_resident_peak(monkeypatch):
    from types import SimpleNamespace

    from hfplan.executor import host_memory

    monkeypatch.setattr(host_memory.resource, "getrusage", lambda who: SimpleNamespace(ru_maxrss=4096))
    assert peak_resident_bytes("") == 4096 * 1024  # Linux reports KiB
