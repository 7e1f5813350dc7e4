"""Gantt chart of a timeline: one row per placement set (and the controller), one bar per call,
coloured by phase; resharding and transfers drawn hatched so they stand out. PNG via matplotlib
(Agg, no display needed) or a self-contained HTML page with an inline SVG."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from hfplan.errors import HfplanError
from hfplan.files import write_atomically
from hfplan.plan import Span

PHASE_COLOURS = {"generation": "#4e79a7", "preparation": "#f28e2b", "training": "#59a14f"}
KIND_COLOURS = {"transition": "#e15759", "transfer": "#9c9c9c"}
SUFFIXES = (".png", ".html")


def check_timeline_path(path: Path) -> None:
    if path.suffix.lower() not in SUFFIXES:
        raise HfplanError(f"--timeline {path}: use a .png or .html file name")
    if not path.parent.exists():
        raise HfplanError(f"--timeline {path}: folder {path.parent} does not exist")


def _colour(span: Span) -> str:
    return KIND_COLOURS.get(span.kind) or PHASE_COLOURS.get(span.phase, "#bab0ac")


def _rows(spans: Sequence[Span], set_labels: Sequence[str]) -> list[tuple[int, str]]:
    """(set index, label) for each row, top to bottom; the controller row only if it has spans."""
    rows = [(i, label) for i, label in enumerate(set_labels)]
    if any(s.set < 0 for s in spans):
        rows.append((-1, "controller"))
    return rows


def write_timeline(path: Path, spans: Sequence[Span], set_labels: Sequence[str], title: str) -> None:
    check_timeline_path(path)
    if path.suffix.lower() == ".png":
        _write_png(path, spans, set_labels, title)
    else:
        write_atomically(path, _html(spans, set_labels, title))


def _write_png(path: Path, spans: Sequence[Span], set_labels: Sequence[str], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = _rows(spans, set_labels)
    y_of = {index: len(rows) - 1 - k for k, (index, _) in enumerate(rows)}
    end = max((s.end for s in spans), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(rows)))
    for span in spans:
        width = span.end - span.start
        if width <= 0:
            continue
        hatch = "//" if span.kind != "compute" else None
        ax.broken_barh([(span.start, width)], (y_of[span.set] - 0.4, 0.8), facecolors=_colour(span),
                       edgecolor="black", linewidth=0.5, hatch=hatch)
        if width > 0.04 * end:
            label = span.op if span.kind != "compute" or span.role == "controller" else f"{span.role}.{span.op}"
            ax.text(span.start + width / 2, y_of[span.set], label, ha="center", va="center", fontsize=7,
                    clip_on=True)
    ax.set_yticks([y_of[i] for i, _ in rows], [label for _, label in rows], fontsize=8)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=10)
    legend = [Patch(facecolor=c, label=p) for p, c in PHASE_COLOURS.items()]
    legend += [Patch(facecolor=c, hatch="//", label=k) for k, c in KIND_COLOURS.items()]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8, frameon=False)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=120)
        tmp.replace(path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)


def _html(spans: Sequence[Span], set_labels: Sequence[str], title: str) -> str:
    rows = _rows(spans, set_labels)
    row_of = {index: k for k, (index, _) in enumerate(rows)}
    end = max((s.end for s in spans), default=1.0) or 1.0
    left, width, row_h = 260, 1000, 34
    height = row_h * len(rows) + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
             'font-family="sans-serif" font-size="11">']
    for k, (_, label) in enumerate(rows):
        parts.append(f'<text x="4" y="{k * row_h + 22}">{html.escape(label)}</text>')
    for span in spans:
        if span.end <= span.start:
            continue
        x = left + span.start / end * width
        w = max(1.0, (span.end - span.start) / end * width)
        y = row_of[span.set] * row_h + 4
        tip = html.escape(f"{span.role}.{span.op} [{span.phase}, {span.kind}] {span.start:.3f}-{span.end:.3f} s")
        dash = ' stroke-dasharray="3,2"' if span.kind != "compute" else ""
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 8}" fill="{_colour(span)}" '
                     f'stroke="black" stroke-width="0.5"{dash}><title>{tip}</title></rect>')
        if w > 60:
            parts.append(f'<text x="{x + w / 2:.1f}" y="{y + 17}" text-anchor="middle">'
                         f'{html.escape(span.role + "." + span.op)}</text>')
    for tick in range(6):
        x = left + tick / 5 * width
        parts.append(f'<text x="{x:.1f}" y="{height - 8}" text-anchor="middle">{end * tick / 5:.1f} s</text>')
    parts.append("</svg>")
    legend = " ".join(f'<span style="background:{c};padding:2px 8px;margin-right:6px">{html.escape(p)}</span>'
                      for p, c in {**PHASE_COLOURS, **KIND_COLOURS}.items())
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body><h3>{html.escape(title)}</h3><p>{legend}</p>{''.join(parts)}</body></html>\n")
