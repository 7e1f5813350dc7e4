"""Gantt chart of a timeline: one row per placement set (and the controller), one bar per call,
coloured by phase; resharding and transfers drawn hatched so they stand out. PNG via matplotlib
(Agg, no display needed) or a self-contained HTML page with an inline SVG. A bar too short to see at the
chart's width is not drawn (nor the controller's row when nothing on it is), and a label that does not fit
inside its bar is left off (the HTML page still shows it as the bar's tooltip)."""

from __future__ import annotations

import html
import io
from collections.abc import Sequence
from pathlib import Path

from hfplan.errors import HfplanError
from hfplan.files import check_writable
from hfplan.plan import Span

PHASE_COLOURS = {"generation": "#4e79a7", "preparation": "#f28e2b", "training": "#59a14f"}
KIND_COLOURS = {"transition": "#e15759", "transfer": "#9c9c9c", "dispatch": "#d4d4d4"}
SUFFIXES = (".png", ".html")
# Both charts draw the time axis about this many pixels wide; a bar under half a pixel is not drawn.
CHART_PX = 1000
# Average width of one label character, as a fraction of the font size (sans-serif).
CHAR_EM = 0.6


def check_timeline_path(path: Path) -> None:
    if path.suffix.lower() not in SUFFIXES:
        raise HfplanError(f"--timeline {path}: use a .png or .html file name")
    check_writable(path, "--timeline")


def _drawn(spans: Sequence[Span], end: float) -> list[Span]:
    """The spans long enough to see: zero-length transfers and the like are left out."""
    return [s for s in spans if (s.end - s.start) / end * CHART_PX >= 0.5]


def _label(span: Span) -> str:
    return span.op if span.kind != "compute" or span.role == "controller" else f"{span.role}.{span.op}"


def _fits(label: str, bar_px: float, font_px: float) -> bool:
    return len(label) * CHAR_EM * font_px + 4 <= bar_px


def _colour(span: Span) -> str:
    return KIND_COLOURS.get(span.kind) or PHASE_COLOURS.get(span.phase, "#bab0ac")


def _rows(spans: Sequence[Span], set_labels: Sequence[str]) -> list[tuple[int, str]]:
    """(set index, label) for each row, top to bottom; the controller row only if it has spans drawn."""
    rows = [(i, label) for i, label in enumerate(set_labels)]
    if any(s.set < 0 for s in spans):
        rows.append((-1, "controller"))
    return rows


def timeline_chart(path: Path, spans: Sequence[Span], set_labels: Sequence[str], title: str) -> bytes:
    """The chart for `path`'s suffix (.png or .html), as the bytes of the file to write."""
    check_timeline_path(path)
    if path.suffix.lower() == ".png":
        return _png(spans, set_labels, title)
    return _html(spans, set_labels, title).encode()


def _png(spans: Sequence[Span], set_labels: Sequence[str], title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    end = max((s.end for s in spans), default=1.0) or 1.0
    drawn = _drawn(spans, end)
    rows = _rows(drawn, set_labels)
    y_of = {index: len(rows) - 1 - k for k, (index, _) in enumerate(rows)}
    dpi, font_pt = 120, 7
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(rows)))
    ax.set_yticks([y_of[i] for i, _ in rows], [label for _, label in rows], fontsize=8)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0, end * 1.01)
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=10)
    legend = [Patch(facecolor=c, label=p) for p, c in PHASE_COLOURS.items()]
    legend += [Patch(facecolor=c, hatch="//", label=k) for k, c in KIND_COLOURS.items()]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8, frameon=False)
    fig.tight_layout()  # the axes' final width, to know which labels fit inside their bars
    axes_px = ax.get_position().width * fig.get_figwidth() * dpi
    for span in drawn:
        width = span.end - span.start
        hatch = "//" if span.kind != "compute" else None
        ax.broken_barh([(span.start, width)], (y_of[span.set] - 0.4, 0.8), facecolors=_colour(span),
                       edgecolor="black", linewidth=0.5, hatch=hatch)
        label = _label(span)
        if _fits(label, width / (end * 1.01) * axes_px, font_pt * dpi / 72):
            ax.text(span.start + width / 2, y_of[span.set], label, ha="center", va="center", fontsize=font_pt,
                    clip_on=True)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return buffer.getvalue()


def _html(spans: Sequence[Span], set_labels: Sequence[str], title: str) -> str:
    end = max((s.end for s in spans), default=1.0) or 1.0
    drawn = _drawn(spans, end)
    rows = _rows(drawn, set_labels)
    row_of = {index: k for k, (index, _) in enumerate(rows)}
    left, width, row_h, font_px = 260, CHART_PX, 34, 11
    height = row_h * len(rows) + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" '
             f'font-family="sans-serif" font-size="{font_px}">']
    for k, (_, label) in enumerate(rows):
        parts.append(f'<text x="4" y="{k * row_h + 22}">{html.escape(label)}</text>')
    for span in drawn:
        x = left + span.start / end * width
        w = max(1.0, (span.end - span.start) / end * width)
        y = row_of[span.set] * row_h + 4
        tip = html.escape(f"{span.role}.{span.op} [{span.phase}, {span.kind}] {span.start:.3f}-{span.end:.3f} s")
        dash = ' stroke-dasharray="3,2"' if span.kind != "compute" else ""
        parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 8}" fill="{_colour(span)}" '
                     f'stroke="black" stroke-width="0.5"{dash}><title>{tip}</title></rect>')
        label = _label(span)
        if _fits(label, w, font_px):
            parts.append(f'<text x="{x + w / 2:.1f}" y="{y + 17}" text-anchor="middle">{html.escape(label)}</text>')
    for tick in range(6):
        x = left + tick / 5 * width
        parts.append(f'<text x="{x:.1f}" y="{height - 8}" text-anchor="middle">{end * tick / 5:.1f} s</text>')
    parts.append("</svg>")
    legend = " ".join(f'<span style="background:{c};padding:2px 8px;margin-right:6px">{html.escape(p)}</span>'
                      for p, c in {**PHASE_COLOURS, **KIND_COLOURS}.items())
    return (f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body><h3>{html.escape(title)}</h3><p>{legend}</p>{''.join(parts)}</body></html>\n")
