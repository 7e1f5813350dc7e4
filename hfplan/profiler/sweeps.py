"""What to measure: shapes and sizes of each sweep, per device kind, full or --quick."""

from __future__ import annotations

from dataclasses import dataclass

KIB, MIB = 2**10, 2**20
# Timed calls per measurement of the training engine (the median kept; hfplan.profiler.runtime); a count, not a
# time, so every rank of a world makes the same collectives. --quick (a test's profile) takes fewer.
ENGINE_REPS, QUICK_ENGINE_REPS = 15, 5


@dataclass(frozen=True)
class LayerCases:
    """Shapes of the transformer-layer measurements: prefill-style (forward, forward+backward) over
    batch x sequence, decode steps over batch x context, each at every tensor-parallel degree."""

    batches: tuple[int, ...]
    seqs: tuple[int, ...]
    decode_batches: tuple[int, ...]
    contexts: tuple[int, ...]
    tps: tuple[int, ...]
    budget_s: float  # predicted seconds the whole layer phase may take; the layer is scaled down to fit


@dataclass(frozen=True)
class Sweeps:
    matmuls: tuple[tuple[int, int, int], ...]  # (m, k, n)
    copy_bytes: tuple[int, ...]  # size of the source of one copy
    message_bytes: tuple[int, ...]  # collective message sizes
    host_bytes: tuple[int, ...]  # device <-> host copies (CUDA only)
    layers: LayerCases
    min_time: float  # seconds of timed calls per point (split over trials)
    comm_min_time: float
    through_ray: bool = True  # engines timed in a Ray worker, and the executor's call gaps measured on a run
    linear_backwards: tuple[tuple[int, int, int], ...] = ()  # (m, k, n) products whose backward pair is timed (CPU)
    engine_reps: int = ENGINE_REPS  # timed calls per measurement of the training engine (the median kept)
    cached_matmuls: tuple[tuple[int, int, int], ...] = ()  # (m, k, n) timed with their operands in the cache (CPU)
    # (op, batch, heads, kv_heads, head_dim, length) of the attention kernel timed alone (CPU: measure_attention)
    attention: tuple[tuple[str, int, int, int, int, int], ...] = ()


# Rows (M) of the skinny GEMMs measured on a GPU against hidden and MLP widths: decode batches (where the GEMM
# library splits K and the weights' read bounds the time) up to training micro-batches (compute-bound).
SMALL_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024)
SMALL_M_QUICK = (1, 8, 64, 256, 1024)


def _square(sizes) -> tuple[tuple[int, int, int], ...]:
    return tuple((s, s, s) for s in sizes)


def _skinny(ms, kns) -> tuple[tuple[int, int, int], ...]:
    return tuple((m, k, n) for m in ms for k, n in kns)


def sweeps_for(kind: str, quick: bool) -> Sweeps:
    if kind == "cuda":
        return Sweeps(
            matmuls=_square((128, 256, 512, 1024, 2048, 4096, 8192) if quick else
                            (64, 128, 256, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384))
            + _skinny(SMALL_M_QUICK if quick else SMALL_M,
                      ((4096, 4096), (4096, 14336), (14336, 4096)) if quick else
                      ((4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192), (8192, 28672))),
            copy_bytes=tuple(2**k for k in range(8, 31, 2 if quick else 1)),
            message_bytes=tuple(2**k for k in range(3, 30, 2 if quick else 1)),
            host_bytes=tuple(2**k for k in range(10, 30, 2 if quick else 1)),
            layers=LayerCases(batches=(1, 8), seqs=(512, 2048), decode_batches=(1, 32, 128),
                              contexts=(1024, 4096), tps=(1, 2, 4, 8), budget_s=30 if quick else 90),
            min_time=0.05 if quick else 0.2,
            comm_min_time=0.02 if quick else 0.1,
            through_ray=not quick,  # --quick skips Ray and the probe run (their start takes seconds)
            engine_reps=QUICK_ENGINE_REPS if quick else ENGINE_REPS,
        )
    # Few rows by weights from ones the core's cache holds (256 KiB in fp32) to ones it streams (16-64 MiB), and
    # 512 rows by each, where the rate is reached: Compute.row_efficiency by rows and weight bytes; the backward of
    # each product of training's rows (16 and up), Compute.backward_row_efficiency. The rate is far from linear in
    # log rows between 1 and 16 (a decode batch's rows), so the full sweep measures the counts in between.
    weights = (((256, 256), (512, 1024), (1024, 1024), (1024, 4096), (4096, 1024)) if quick else
               ((256, 256), (512, 1024), (1024, 1024), (1024, 4096), (4096, 1024), (2048, 2048), (4096, 4096)))
    # The same rows by weights a small model's generation step keeps in the cache (16 KiB to 4 MiB in fp32), timed
    # with their operands there: Compute.cached_row_efficiency.
    cached = (((64, 64), (256, 256), (512, 1024)) if quick else
              ((64, 64), (128, 128), (256, 256), (512, 512), (512, 2048)))
    # The attention kernel at the executor's shapes, from the demo models' heads (4 of 16 wide, 2 KV heads) to wider
    # ones (8 of 64, 4 KV heads), one sequence to a batch of 32, from the lengths the demo workloads run to the
    # longer ones of the layer table (a causal pass of at most 8192 tokens a call): each (sequence, query head)
    # pair's set-up and each score's softmax against the products (Compute.measured_attention).
    heads = ((4, 2, 16), (8, 4, 64))
    lengths = {"decode": (8, 64, 1024) if quick else (8, 32, 128, 512, 2048),
               "forward": (16, 256) if quick else (16, 64, 256, 1024)}
    attention = tuple((op, batch, *shape, length) for op in ("decode", "forward")
                      for batch in ((1, 32) if quick else (1, 8, 32)) for shape in heads for length in lengths[op]
                      if op == "decode" or batch * length <= 8192)
    return Sweeps(
        attention=attention,
        cached_matmuls=_skinny((1, 8, 64, 512) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 512), cached),
        matmuls=_square((16, 64, 128, 256, 512, 1024) if quick else (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048))
        + _skinny((1, 8, 16, 128, 512) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 512), weights),
        linear_backwards=_skinny((16, 128, 512) if quick else (16, 32, 64, 128, 512), weights),
        copy_bytes=tuple(2**k for k in (range(6, 27, 2) if quick else range(6, 31))),
        message_bytes=tuple(2**k for k in (range(3, 25, 3) if quick else range(3, 29))),
        host_bytes=(),
        layers=(LayerCases(batches=(1, 4), seqs=(128, 512), decode_batches=(1, 8), contexts=(256, 1024),
                           tps=(1, 2), budget_s=12) if quick else
                LayerCases(batches=(1, 4, 8), seqs=(128, 512, 1024), decode_batches=(1, 8, 32),
                           contexts=(256, 1024, 4096), tps=(1, 2, 4), budget_s=120)),
        min_time=0.06 if quick else 0.3,
        comm_min_time=0.03 if quick else 0.15,
        through_ray=not quick,  # --quick skips Ray and the probe run (their start takes seconds)
        engine_reps=QUICK_ENGINE_REPS if quick else ENGINE_REPS,
    )
