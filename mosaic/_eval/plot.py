"""The frontier picture of an evaluation: each candidate's KL (and top-1) against its size.

A mosaic is worth publishing where it sits below the line its rivals draw (lower KL at the same bytes), and
a picture shows that at a glance. The sizes are the candidates' files as they are on disk (every part of a
GGUF model, every ``.safetensors`` shard of an EXL3 folder); the teacher sits at KL 0 and top-1 1 at its own
size when it is a model. matplotlib (the ``plot`` extra) draws it, imported only here and checked before any
model runs. The SVG is the same bytes for the same inputs: no date, a fixed hash salt, text kept as text.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

from mosaic._base.errors import MosaicError

SUFFIXES = (".svg", ".png")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """matplotlib's own messages (a font cache being built, a cache folder it cannot write) stay out of the
    command's output."""
    log = logging.getLogger("matplotlib")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def check_plot(path: Path) -> None:
    """Refuse a picture that cannot be drawn (its format, the missing extra) before any model runs."""
    if path.suffix.lower() not in SUFFIXES:
        raise MosaicError(f"--plot {path}: draws .svg or .png, not {path.suffix or 'a file without a suffix'}")
    try:
        with _quiet():
            import matplotlib  # noqa: F401
    except ImportError:
        raise MosaicError("--plot needs matplotlib, the plot extra: pip install 'mosaic[plot]'") from None


def model_bytes(path: Path) -> int:
    """A model's size on disk: a GGUF model's files (every part of a split set), an EXL3 folder's shards."""
    from mosaic._checkpoint.gguf_model import find_model_files

    if path.is_dir() and any(path.glob("*.safetensors")):
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    root, files = find_model_files(path)
    return sum((root / f).stat().st_size for f in files)


def _label(name: str) -> str:
    p = Path(name)
    return p.name or name


#: The colours of a picture's series, in the order they first come (the first one the rivals', say, the last mosaic's).
COLOURS = ("#1f5fa8", "#7f7f7f", "#2e8b57", "#b8860b", "#8e44ad", "#c0392b")


def draw(path: Path, candidates: Sequence[dict], sizes: Sequence[int], teacher: tuple[str, int] | None, title: str,
         series: Sequence[str] | None = None, labels: Sequence[str | None] | None = None) -> None:
    """KL mean and top-1 of each candidate against its bytes, one labelled point each, into ``path``. With
    ``series`` (a name per candidate), the points of one series are joined in the order of their sizes, in a
    colour of their own, and named in a legend: a frontier per quantizer. ``labels`` replace the file names
    beside the points (``None``: no label)."""
    with _quiet():
        import matplotlib as mpl
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.backends.backend_svg import FigureCanvasSVG
        from matplotlib.figure import Figure

        with mpl.rc_context({"svg.hashsalt": "mosaic", "svg.fonttype": "none", "font.size": 9}):
            fig = Figure(figsize=(11, 4.6), layout="constrained")
            kl_ax, top_ax = fig.subplots(1, 2)
            xs = [s / 1e6 for s in sizes]
            names = labels if labels is not None else [_label(c["model"]) for c in candidates]
            points = [(x, c["kl"]["mean"], c["top1"], n) for x, c, n in zip(xs, candidates, names)]
            groups = list(dict.fromkeys(series)) if series is not None else [None]
            t = (teacher[1] / 1e6, 0.0, 1.0, f"{_label(teacher[0])} (teacher)") if teacher is not None else None
            for ax, key, what in ((kl_ax, 1, "KL(teacher ‖ candidate), mean, nats"), (top_ax, 2, "top-1 agreement with the teacher")):
                for i, g in enumerate(groups):
                    mine = sorted(p for j, p in enumerate(points) if series is None or series[j] == g)
                    colour = COLOURS[i % len(COLOURS)]
                    ax.scatter([p[0] for p in mine], [p[key] for p in mine], s=22, color=colour, zorder=3, label=g)
                    if g is not None:
                        ax.plot([p[0] for p in mine], [p[key] for p in mine], color=colour, linewidth=1, zorder=2)
                if t is not None:
                    ax.scatter([t[0]], [t[key]], s=60, marker="*", color="#b03a2e", zorder=4)
                for p in [*points, *([t] if t is not None else [])]:
                    if p[3]:
                        ax.annotate(p[3], (p[0], p[key]), textcoords="offset points", xytext=(5, 4), fontsize=7)
                if series is not None:
                    ax.legend(fontsize=7)
                ax.set_xlabel("size on disk, MB")
                ax.set_ylabel(what)
                ax.grid(True, color="#dddddd", zorder=0)
            fig.suptitle(title)
            if path.suffix.lower() == ".svg":
                FigureCanvasSVG(fig).print_svg(str(path), metadata={"Date": None})
            else:
                FigureCanvasAgg(fig).print_png(str(path), metadata={"Software": None})
