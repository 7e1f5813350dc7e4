"""Plain descriptions of plans and search candidates, for tables and the candidates CSV."""

from __future__ import annotations

import pandas as pd

from hfplan.plan import Layout, RoleParallelism, TrainConfig
from hfplan.planner.search import Candidate, SearchResult
from hfplan.spec import Workload


def _layout(layout: Layout) -> str:
    return f"t{layout.tp}p{layout.pp}d{layout.dp}"


def _sharding(train: TrainConfig) -> str:
    """The legend's names: nothing when no state is split; zero1, zero2; fsdp (ZeRO-3); hsdpG (hybrid)."""
    if train.shard_size == 1:
        return ""
    names = {"zero1": " zero1", "zero2": " zero2", "full": " fsdp"}
    return names.get(train.shard, f" hsdp{train.shard_group}")


def describe_role(par: RoleParallelism) -> str:
    parts = []
    if par.train is not None:
        t = par.train
        parts.append(f"train {_layout(t)}{f'v{t.virtual_stages}' if t.virtual_stages > 1 else ''} "
                     f"mb{t.micro_batch}{_sharding(t)}{f' {t.recompute}-recompute' if t.recompute else ''}")
    if par.infer is not None:
        parts.append(f"infer {_layout(par.infer)} mb{par.infer.micro_batch}" if par.train is None
                     else f"infer mb{par.infer.micro_batch}")
    if par.gen is not None:
        g = par.gen
        cap = f" max{g.max_batch}" if g.max_batch is not None else ""
        paged = " paged" if g.kv_cache == "paged" else ""
        parts.append(f"gen {_layout(g)}{' cb' if g.batching == 'continuous' else ''}{paged}{cap}")
    return ", ".join(parts)


def status_counts(result: SearchResult) -> dict[str, int]:
    """Candidates per status, as the candidates CSV has them (its rows)."""
    counts = dict.fromkeys(("evaluated", "pruned", "infeasible", "open"), 0)
    for candidate in result.candidates:
        counts[candidate.status] += 1
    return counts


def candidates_frame(result: SearchResult, workload: Workload) -> pd.DataFrame:
    """One row per (placement, allocation) the search considered, with its outcome."""

    def row(c: Candidate) -> dict:
        feasible = c.status == "evaluated"
        return {
            "placement": " | ".join("+".join(roles) for roles in c.placement),
            "gpus": " | ".join([str(a) for a in c.allocation] + ["*"] * (len(c.placement) - len(c.allocation))),
            "status": c.status,
            "iteration_s": round(c.iteration_s, 4) if feasible else None,
            "tokens_per_s": round(workload.tokens_per_iteration / c.iteration_s, 1) if feasible else None,
            "peak_gib_per_gpu": " | ".join(f"{p:.1f}" for p in c.peak_gib),
            "parallelism": "; ".join(f"{r}: {describe_role(p)}" for r, p in (c.pars or {}).items()),
            "reason": c.reason,
        }

    frame = pd.DataFrame([row(c) for c in result.candidates])
    return frame.sort_values(["status", "iteration_s"], na_position="last", kind="stable")
