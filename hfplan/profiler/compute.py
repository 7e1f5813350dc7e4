"""Kernel measurements on one device: matmul throughput over shapes, memory copies over sizes, and
device <-> host copies (CUDA). Each returns rows for the raw-measurements table."""

from __future__ import annotations

from collections.abc import Callable

from hfplan.profiler.device import Device
from hfplan.profiler.timing import Clock, copies_for, rotating

Step = Callable[[], None]


def compute_dtype(device: Device):
    """The dtype the executor's models compute in on this device (its rule: hfplan.executor.mesh)."""
    from hfplan.executor import mesh

    return mesh.compute_dtype(device.kind)


def rotation_budget(device: Device) -> float:
    """Bytes of rotating operand copies one measurement may allocate."""
    return min(4 * 2**30 if device.kind == "cuda" else 2**30, 0.1 * device.capacity_bytes)


def measure_matmuls(torch, device: Device, shapes, min_time: float, step: Step) -> list[dict]:
    dtype = compute_dtype(device)
    esize = torch.empty((), dtype=dtype).element_size()
    clock = Clock(torch, device.kind)
    rows = []
    for m, k, n in shapes:
        nbytes = esize * (m * k + k * n + m * n)
        copies = copies_for(nbytes, device.cache_bytes, rotation_budget(device))
        # The copies are clones of one random pair (drawing each at random took a second per shape on a CPU); outputs
        # are zeroed, not just allocated: a first write to fresh pages would be timed otherwise.
        a, b = torch.randn(m, k, dtype=dtype, device=device.kind), torch.randn(k, n, dtype=dtype, device=device.kind)
        sets = [(a.clone(), b.clone(), torch.zeros(m, n, dtype=dtype, device=device.kind)) for _ in range(copies)]
        del a, b
        following = rotating(sets)

        def matmul(following=following) -> None:
            a, b, out = following()
            torch.mm(a, b, out=out)

        seconds = clock.per_call(matmul, min_time)
        flops = 2.0 * m * k * n
        rows.append(dict(kind="matmul", op="mm", dtype=str(dtype).removeprefix("torch."), m=m, k=k, n=n,
                         flops=flops, bytes=float(nbytes), seconds=seconds, rate=flops / seconds))
        del sets, following
        step()
    return rows


def measure_copies(torch, device: Device, sizes, min_time: float, step: Step) -> list[dict]:
    """dst.copy_(src) of `size` bytes: reads and writes size bytes each (2*size moved). Source and
    destination rotate over views of two buffers larger than twice the last-level cache (where the
    memory budget allows), so each copy streams from memory as a layer's weights would."""
    clock = Clock(torch, device.kind)
    buffer_bytes = max(2 * device.cache_bytes, max(sizes))
    buffer_bytes = int(max(min(buffer_bytes, rotation_budget(device) / 2), max(sizes)))
    source = torch.ones(buffer_bytes // 4, dtype=torch.float32, device=device.kind)
    target = torch.zeros_like(source)
    rows = []
    for size in sizes:
        elements = max(1, size // 4)
        views = max(1, min(source.numel() // elements, 16384))
        # Offsets are staggered between source and target so that no copy is in place.
        pairs = [(source[i * elements:(i + 1) * elements], target[((i + 1) % views) * elements:
                                                                  ((i + 1) % views + 1) * elements])
                 for i in range(views)]
        following = rotating(pairs)

        def copy(following=following) -> None:
            src, dst = following()
            dst.copy_(src)

        seconds = clock.per_call(copy, min_time)
        moved = 8.0 * elements
        rows.append(dict(kind="memory", op="copy", dtype="float32", bytes=moved, flops=0.0, seconds=seconds,
                         rate=moved / seconds))
        del pairs, following
        step()
    return rows


def measure_host_copies(torch, device: Device, sizes, min_time: float, step: Step) -> list[dict]:
    """Pinned host <-> device copies (CUDA): the host link."""
    clock = Clock(torch, device.kind)
    rows = []
    for size in sizes:
        elements = max(1, size // 4)
        host = torch.empty(elements, dtype=torch.float32, pin_memory=True)
        dev = torch.empty(elements, dtype=torch.float32, device=device.kind)
        for op, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            seconds = clock.per_call(lambda dst=dst, src=src: dst.copy_(src, non_blocking=True), min_time)
            rows.append(dict(kind="host", op=op, bytes=4.0 * elements, steps=1.0, moved_bytes=4.0 * elements,
                             seconds=seconds, rate=4.0 * elements / seconds))
        del host, dev
        step()
    return rows
