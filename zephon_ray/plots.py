"""Pictures of one global batch (matplotlib): what a step is made of, for ``zephon-ray show --plot`` and notebooks.

    summary = batch_summary(batch)            # numbers only: source share, document pieces, packing
    plot_batch(batch, "step3.png")            # three panels, written as PNG

A *document piece* is a run of tokens whose positions count up from 0 inside one row: packing resets positions at
every document start, so the pieces are what attention sees. Limit: a document that wraps over a row boundary
appears as two pieces, and a piece that started in an earlier step is counted from its first token in this batch.
Packing efficiency is the share of non-pad tokens; ``wrap`` packing never pads, so it is 1.0 there.

Guarantee: the PNG is written whole or not at all; a path that cannot take it (a directory, a missing or read-only
parent) is one :class:`~zephon_ray.errors.UserInputError` from :func:`check_plot_path`, before any work.
Limits: needs matplotlib (the ``plots`` extra).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zephon_ray.batch import GlobalBatch
from zephon_ray.errors import UserInputError


@dataclass(frozen=True)
class BatchSummary:
    step: int
    source_share: dict[str, float]
    piece_lengths: np.ndarray
    """Length in tokens of every document piece, all rows."""
    pieces_per_row: np.ndarray
    packing_efficiency: np.ndarray
    """Per row: non-pad tokens / row length."""


def document_pieces(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(piece lengths, pieces per row) from a [rows, length] positions array; a piece starts where positions
    do not continue the previous token's count (a reset to 0, or the row's first token)."""
    lengths: list[np.ndarray] = []
    per_row = np.zeros(positions.shape[0], dtype=np.int64)
    for r, row in enumerate(np.asarray(positions)):
        starts = np.flatnonzero(np.r_[True, row[1:] != row[:-1] + 1])
        lengths.append(np.diff(np.r_[starts, row.size]))
        per_row[r] = starts.size
    return np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64), per_row


def batch_summary(batch: GlobalBatch) -> BatchSummary:
    lengths, per_row = document_pieces(batch.positions)
    tokens = np.asarray(batch.tokens)
    if batch.pad_token_id is None:
        efficiency = np.ones(tokens.shape[0])
    else:
        efficiency = (tokens != batch.pad_token_id).mean(axis=1)
    return BatchSummary(batch.step, batch.source_share(), lengths, per_row, efficiency)


def check_plot_path(path: str | Path, what: str = "plot") -> Path:
    """The file a PNG can be written to, or one :class:`UserInputError` naming ``path`` and why not. The parent
    directory must exist (nothing is created), and matplotlib (the ``plots`` extra) must be installed."""
    out = Path(path)
    if out.is_dir():
        raise UserInputError(f"{what} {path}: is a directory; give a file name, e.g. {out / 'step.png'}")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise UserInputError(f"{what} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise UserInputError(f"{what} {path}: not writable")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserInputError(f"{what} {path}: plots need matplotlib: pip install 'zephon-ray[plots]'") from None
    return out


def plot_batch(batch: GlobalBatch, path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG with per-source token share, the document-piece length histogram and per-row packing."""
    out = check_plot_path(path)
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed (headless servers, CI)
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    summary = batch_summary(batch)
    fig, (ax_share, ax_len, ax_pack) = plt.subplots(1, 3, figsize=(15, 4.2))
    names = list(summary.source_share)
    shares = [summary.source_share[n] for n in names]
    # tab10 is a ListedColormap, whose colors the stubs type as any array-like
    bars = ax_share.bar(names, shares, color=plt.cm.tab10.colors[: len(names)])  # type: ignore[attr-defined]
    ax_share.bar_label(bars, labels=[f"{s:.1%}" for s in shares])
    ax_share.set_ylim(0, 1.1)
    ax_share.set_ylabel("share of tokens")
    ax_share.set_title("per-source token share")

    lengths = summary.piece_lengths
    span = int(lengths.max() - lengths.min()) if lengths.size else 0
    bins = np.arange(lengths.min() - 0.5, lengths.max() + 1.5) if span < 40 else 40  # whole tokens when few
    ax_len.hist(lengths, bins=bins, color="tab:blue", rwidth=0.9)
    ax_len.set_xlabel("document piece length (tokens)")
    ax_len.set_ylabel("pieces")
    ax_len.set_title(
        f"document pieces: {summary.piece_lengths.size}, median "
        f"{int(np.median(summary.piece_lengths)) if summary.piece_lengths.size else 0} tokens"
    )

    top = int(summary.pieces_per_row.max()) if summary.pieces_per_row.size else 1
    ax_pack.hist(summary.pieces_per_row, bins=np.arange(0.5, top + 1.5), color="tab:green", rwidth=0.85)
    ax_pack.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax_len.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax_pack.set_xlabel("document pieces per row")
    ax_pack.set_ylabel("rows")
    ax_pack.set_title(f"packing: {summary.packing_efficiency.mean():.1%} non-pad tokens")

    fig.suptitle(title or f"step {batch.step}  digest {batch.digest[:16]}")
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        fig.savefig(tmp, dpi=100, format="png")
        os.replace(tmp, out)  # whole or not at all
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return out
