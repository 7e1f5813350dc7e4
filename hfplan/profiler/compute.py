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


def measure_matmuls(torch, device: Device, shapes, min_time: float, step: Step, cached: bool = False) -> list[dict]:
    """(m x k) inputs times (k x n) weights as nn.Linear multiplies them: the weight stored n x k and read
    transposed. A CPU BLAS's speed depends on that layout (a row-major k x n operand whose rows are a power of two
    apart in memory ran 128-row products at two thirds of the rate on the project's VM; the transposed one did not).
    Each call reads operands the last calls left out of the cache; `cached`: the same operands every call, so they
    stay in it (rows of kind "matmul_cached": Compute.cached_row_efficiency)."""
    dtype = compute_dtype(device)
    esize = torch.empty((), dtype=dtype).element_size()
    clock = Clock(torch, device.kind)
    rows = []
    for m, k, n in shapes:
        nbytes = esize * (m * k + k * n + m * n)
        following = (_cached_operands(torch, device, dtype, [(m, k), (n, k)], [(m, n)]) if cached
                     else _rotating_operands(torch, device, dtype, nbytes, [(m, k), (n, k)], [(m, n)]))

        def matmul(following=following) -> None:
            x, weight, out = following()
            torch.mm(x, weight.t(), out=out)

        seconds = clock.per_call(matmul, min_time)
        flops = 2.0 * m * k * n
        rows.append(dict(kind="matmul_cached" if cached else "matmul", op="linear",
                         dtype=str(dtype).removeprefix("torch."), m=m, k=k, n=n, flops=flops, bytes=float(nbytes),
                         seconds=seconds, rate=flops / seconds))
        del following
        step()
    return rows


def measure_linear_backwards(torch, device: Device, shapes, min_time: float, step: Step) -> list[dict]:
    """The backward of each (m x k)(k x n) product as nn.Linear's runs it: the input gradient dY @ W, (m x n)(n x k),
    and the weight gradient dY^T @ X, (n x m)(m x k), timed together (Compute.backward_row_efficiency)."""
    dtype = compute_dtype(device)
    esize = torch.empty((), dtype=dtype).element_size()
    clock = Clock(torch, device.kind)
    rows = []
    for m, k, n in shapes:
        nbytes = esize * 2 * (m * n + n * k + m * k)  # each GEMM's two operands and its output
        following = _rotating_operands(torch, device, dtype, nbytes, [(m, k), (n, k), (m, n)],
                                       [(m, k), (n, k)])

        def backward(following=following) -> None:
            x, weight, grad_out, grad_in, grad_weight = following()
            torch.mm(grad_out, weight, out=grad_in)
            torch.mm(grad_out.t(), x, out=grad_weight)

        seconds = clock.per_call(backward, min_time)
        flops = 4.0 * m * k * n
        rows.append(dict(kind="matmul_backward", op="linear_backward", dtype=str(dtype).removeprefix("torch."),
                         m=m, k=k, n=n, flops=flops, bytes=float(nbytes), seconds=seconds, rate=flops / seconds))
        del following
        step()
    return rows


def _cached_operands(torch, device: Device, dtype, inputs, outputs):
    """One set of random `inputs` and zeroed `outputs`, returned at every call (they stay in the cache)."""
    operands = (tuple(torch.randn(*shape, dtype=dtype, device=device.kind) for shape in inputs)
                + tuple(torch.zeros(*shape, dtype=dtype, device=device.kind) for shape in outputs))
    return lambda: operands


def _rotating_operands(torch, device: Device, dtype, nbytes: float, inputs, outputs):
    """Copies of random tensors of the `inputs` shapes and of zeroed ones of the `outputs` shapes to rotate
    through, enough that each call reads its operands from memory, not from a cache the last call filled. The
    copies are clones of one random set (drawing each at random took a second per shape on a CPU); outputs are
    zeroed, not just allocated: a first write to fresh pages would be timed otherwise."""
    copies = copies_for(nbytes, device.cache_bytes, rotation_budget(device))
    first = [torch.randn(*shape, dtype=dtype, device=device.kind) for shape in inputs]
    sets = [tuple(t.clone() for t in first) + tuple(torch.zeros(*shape, dtype=dtype, device=device.kind)
                                                    for shape in outputs) for _ in range(copies)]
    return rotating(sets)


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


def measure_attention(torch, device: Device, cases, min_time: float, step: Step) -> list[dict]:
    """torch's scaled_dot_product_attention as the executor calls it, at each (op, batch, heads, kv_heads, head_dim,
    length) case: `decode`, one query a sequence against the first `length` positions of a KV cache (a view of a
    longer one) under a boolean mask, as the torch rollout engine's step runs it; `forward`, a causal pass over
    sequences of `length` under a boolean mask, as its prefill and a padded batch of the training engine run it
    (rows of kind "attention": Compute.measured_attention). `flops` counts the math as the simulator does (a causal
    query attends to (length + 1) / 2 keys on average)."""
    import torch.nn.functional as F

    dtype = compute_dtype(device)
    clock = Clock(torch, device.kind)
    rows = []

    def tensor(*shape):
        return torch.randn(*shape, dtype=dtype, device=device.kind)

    for op, batch, heads, kv_heads, head_dim, length in cases:
        if op == "decode":
            q, cache_k, cache_v = tensor(batch, heads, 1, head_dim), *(tensor(batch, kv_heads, 2 * length, head_dim)
                                                                       for _ in range(2))
            k, v = cache_k.narrow(2, 0, length), cache_v.narrow(2, 0, length)
            mask = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=device.kind)
            keys = length
        else:
            q, k, v = tensor(batch, heads, length, head_dim), *(tensor(batch, kv_heads, length, head_dim)
                                                               for _ in range(2))
            mask = torch.ones(length, length, dtype=torch.bool, device=device.kind).tril().expand(batch, 1, -1, -1)
            keys = (length + 1) / 2

        def attend(q=q, k=k, v=v, mask=mask, grouped=heads != kv_heads) -> None:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)

        seconds = clock.per_call(attend, min_time)
        queries = batch * (1 if op == "decode" else length)
        flops = 4.0 * queries * keys * heads * head_dim
        rows.append(dict(kind="attention", op=op, dtype=str(dtype).removeprefix("torch."), batch=batch, heads=heads,
                         kv_heads=kv_heads, hidden=heads * head_dim, **{"context" if op == "decode" else "seq": length},
                         flops=flops, seconds=seconds, rate=flops / seconds))
        step()
    return rows
