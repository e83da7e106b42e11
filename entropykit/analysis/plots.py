"""Plots of an analysis Report: where the bits go, and what the values look like.

What it is: ``plot(report, out)`` writes one figure, as PNG (``.png``) or as a
self-contained HTML page (``.html``: the PNG inline, then the text table), with three
panels: (1) per dtype, a stacked bar per element of the fields' carried bits (solid) and
their slack (light), with the container's achieved size marked where known; (2)
histograms of log2|w| per tensor family (role), quarter-octave bins; (3) the exponent
distribution, floor(log2|w|), per float dtype. What it is not: a statistic; everything
drawn is in the Report. matplotlib is an optional dependency (the ``plots`` extra),
imported only here and only when ``plot`` runs; no pyplot, so no global state or GUI.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from .magnitude import BINS_PER_OCTAVE
from .report import Report

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f")


def _figure():  # -> matplotlib.figure.Figure
    try:
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib: pip install 'entropykit[plots]'") from e
    return Figure(figsize=(18, 5.2), layout="constrained")


def _quantile_range(h: dict[int, int], tail: float = 1e-3) -> tuple[int, int]:
    """The keys of ``h`` between which all but ``tail`` of its mass lies (each side)."""
    ks = sorted(h)
    n = sum(h.values())
    acc, lo = 0, ks[0]
    for k in ks:
        acc += h[k]
        if acc > tail * n:
            lo = k
            break
    return lo, ks[-1]


def _legend(ax) -> None:
    """The legend beside the panel, outside its axes (the layout makes room), so that it
    never covers a bar, a curve or a label, whatever the data."""
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _bits_panel(ax, rep: Report) -> None:
    # Dtypes with a negligible share of the bytes (position ids...) would only squash the
    # scale: left out, and said so in the title.
    total = max(rep.nbytes, 1)
    groups = [g for g in rep.groups("dtype") if g.elements and g.nbytes >= 1e-3 * total]
    colors: dict[str, str] = {}
    for x, g in enumerate(groups):
        bottom = 0.0
        per = g.elements
        for f in g.fields:
            new = f.name not in colors
            color = colors.setdefault(f.name, _COLORS[len(colors) % len(_COLORS)])
            carried = f.carried_bits / per
            allocated = 8 * f.symbols / per
            ax.bar(x, carried, bottom=bottom, color=color, edgecolor="white",
                   label=f.name if new else None)
            ax.bar(x, allocated - carried, bottom=bottom + carried, color=color, alpha=0.25,
                   edgecolor="white")
            if carried > 0.6:
                ax.text(x, bottom + carried / 2, f"{carried:.2f}", ha="center", va="center",
                        fontsize=7, color="white")
            bottom += allocated
        if g.coded is not None:
            ax.plot([x - 0.4, x + 0.4], [8 * g.coded / per] * 2, color="black", lw=2,
                    label="entropykit coded" if x == 0 else None)
        ax.text(x, bottom, f"{g.ratio:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(groups)), [g.key for g in groups], rotation=30, ha="right")
    ax.set_ylabel("bits per element (solid: carried, light: slack)")
    ax.set_title("Entropy vs allocated bits per field\n(bound ratio on top; dtypes >= 0.1% "
                 "of bytes)", fontsize=10)
    _legend(ax)


def _log2_panel(ax, rep: Report) -> None:
    families: dict[str, dict[int, int]] = {}
    for r in rep.rows:
        if r.log2 is None:
            continue
        h = families.setdefault(r.role, {})
        for k, c in r.log2.bins:
            h[k] = h.get(k, 0) + c
    families = {k: v for k, v in families.items() if v}
    lo = hi = 0
    for i, (role, h) in enumerate(sorted(families.items())):
        n = sum(h.values())
        ks = range(min(h), max(h) + 1)  # contiguous: empty bins drawn as zero
        ax.stairs([BINS_PER_OCTAVE * h.get(k, 0) / n for k in ks],
                  [k / BINS_PER_OCTAVE for k in ks] + [(ks[-1] + 1) / BINS_PER_OCTAVE],
                  color=_COLORS[i % len(_COLORS)], label=f"{role} ({n:,})")
        a, b = _quantile_range(h)
        lo, hi = (a, b + 1) if i == 0 else (min(lo, a), max(hi, b + 1))
    ax.set_yscale("log")
    if families:
        ax.set_xlim(lo / BINS_PER_OCTAVE - 0.5, hi / BINS_PER_OCTAVE + 0.5)
        _legend(ax)
    ax.set_xlabel("log2 |w|  (zeros, non-finite values and the 0.1% smallest left out)")
    ax.set_ylabel("density per octave")
    ax.set_title("log2|w| per tensor family", fontsize=10)


def _exponent_panel(ax, rep: Report) -> None:
    by_dtype: dict[str, dict[int, int]] = {}
    zeros: dict[str, int] = {}
    for r in rep.rows:
        if r.log2 is None:
            continue
        h = by_dtype.setdefault(r.dtype, {})
        for e, c in r.log2.octaves().items():
            h[e] = h.get(e, 0) + c
        zeros[r.dtype] = zeros.get(r.dtype, 0) + r.log2.zeros
    by_dtype = {k: v for k, v in by_dtype.items() if v}
    lo = hi = 0
    for i, (dtype, h) in enumerate(sorted(by_dtype.items())):
        n = sum(h.values()) + zeros[dtype]
        es = range(min(h), max(h) + 1)
        ax.stairs([h.get(e, 0) / n for e in es], [*es, es[-1] + 1], lw=1.5,
                  color=_COLORS[i % len(_COLORS)],
                  label=f"{dtype} (zeros {zeros[dtype] / n:.2%})")
        a, b = _quantile_range(h)
        lo, hi = (a, b + 1) if i == 0 else (min(lo, a), max(hi, b + 1))
    if by_dtype:
        ax.set_xlim(lo - 0.5, hi + 0.5)
        _legend(ax)
    ax.set_xlabel("exponent: floor(log2 |w|)")
    ax.set_ylabel("fraction of values")
    ax.set_title("Exponent distribution per dtype", fontsize=10)


def figure(rep: Report):  # -> matplotlib.figure.Figure
    """The three-panel figure of ``rep`` (a matplotlib Figure, not attached to pyplot)."""
    fig = _figure()
    axes = fig.subplots(1, 3, width_ratios=(1.0, 1.3, 1.3))
    _bits_panel(axes[0], rep)
    _log2_panel(axes[1], rep)
    _exponent_panel(axes[2], rep)
    fig.suptitle(f"entropykit analyze {rep.source}: {len(rep.rows)} tensors, "
                 f"{rep.nbytes / 1e6:.1f} MB, bound ratio {rep.total.ratio:.4f}", fontsize=10)
    return fig


def png_bytes(rep: Report, dpi: int = 110) -> bytes:
    """``rep``'s figure as PNG bytes (for notebooks: ``IPython.display.Image(...)``)."""
    buf = io.BytesIO()
    figure(rep).savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def plot(rep: Report, out: str | Path, *, top: int | None = 20) -> Path:
    """Write ``rep``'s figure to ``out``: PNG, or HTML (figure + table) by its suffix."""
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".png", ".html", ".htm"):
        raise ValueError(f"{out}: plot output must end in .png or .html")
    png = png_bytes(rep)
    if suffix == ".png":
        out.write_bytes(png)
    else:
        b64 = base64.b64encode(png).decode("ascii")
        out.write_text(
            "<!doctype html><html><head><meta charset='utf-8'><title>entropykit analyze"
            f"</title></head><body><img alt='entropykit analysis' src='data:image/png;"
            f"base64,{b64}'><pre>{html.escape(rep.to_table(top))}</pre></body></html>\n",
            encoding="utf-8")
    return out
