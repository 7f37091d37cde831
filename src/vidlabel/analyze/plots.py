"""Figures of the report (matplotlib, no display). Each one renders, as a placeholder that says why,
when there is nothing to draw, so the report never breaks on a small or failed run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from vidlabel.core.io import atomic_path  # noqa: E402

_SIZE = (7.5, 4.5)


def _save(fig, path: str | Path) -> None:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def placeholder(path: str | Path, title: str, message: str) -> None:
    fig, ax = plt.subplots(figsize=_SIZE)
    ax.set_axis_off()
    ax.set_title(title)
    ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, fontsize=11, color="0.35",
            transform=ax.transAxes)
    _save(fig, path)


def token_histogram(values: np.ndarray, path: str | Path, title: str, xlabel: str) -> None:
    """Histogram of tokens per request with mean and p99 marked (seed 000, Figures 1 and 2)."""
    values = np.asarray(values, dtype=float)
    values = values[~np.isnan(values)]
    if values.size == 0:
        placeholder(path, title, "No request reported token usage\n(no classified post yet, or every request failed).")
        return
    fig, ax = plt.subplots(figsize=_SIZE)
    bins = min(60, max(5, int(math.sqrt(values.size))))
    ax.hist(values, bins=bins, color="#4c72b0", edgecolor="white", linewidth=0.4)
    mean, p99 = values.mean(), np.percentile(values, 99)
    ax.axvline(mean, color="#c44e52", linestyle="--", label=f"mean {mean:,.0f}")
    ax.axvline(p99, color="#8172b2", linestyle=":", label=f"p99 {p99:,.0f}")
    ax.set_title(f"{title} (n = {values.size:,})")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requests")
    ax.legend(frameon=False)
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)


def token_histograms_by_kind(values: dict[str, np.ndarray], path: str | Path, title: str) -> None:
    """One histogram per kind of input tokens (``values``: kind -> tokens per request that sends that
    kind, zeros left out), side by side: video, image and text tokens differ by orders of magnitude."""
    values = {kind: np.asarray(v, dtype=float) for kind, v in values.items()}
    values = {kind: v[~np.isnan(v) & (v > 0)] for kind, v in values.items()}
    if not any(v.size for v in values.values()):
        placeholder(path, title, "No classified post has a token estimate by kind\n(labels merged without the "
                                 "manifest's per-kind estimates, or no classified post yet).")
        return
    fig, axes = plt.subplots(1, len(values), figsize=(4.2 * len(values), 4.0), squeeze=False)
    colors = {"video": "#4c72b0", "image": "#55a868", "text": "#8172b2"}
    for ax, (kind, v) in zip(axes[0], values.items()):
        if not v.size:
            ax.set_axis_off()
            ax.set_title(f"{kind}: no request")
            ax.text(0.5, 0.5, f"no classified post\nsends {kind}", ha="center", va="center", color="0.35",
                    transform=ax.transAxes)
            continue
        bins = min(60, max(5, int(math.sqrt(v.size))))
        ax.hist(v, bins=bins, color=colors.get(kind, "0.5"), edgecolor="white", linewidth=0.4)
        mean = v.mean()
        ax.axvline(mean, color="#c44e52", linestyle="--", label=f"mean {mean:,.0f}")
        ax.set_title(f"{kind} (n = {v.size:,})")
        ax.set_xlabel(f"{kind} tokens per request (estimated)")
        ax.set_ylabel("requests")
        ax.legend(frameon=False, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    _save(fig, path)


def prevalence(rows: Sequence[dict[str, Any]], path: str | Path, confidence: float,
               sampling_probabilities: np.ndarray | None = None) -> None:
    """Per question: model share, human-only share and bias-corrected estimate, with interval bars.

    With a weighted human sample (``sampling_probabilities`` of the labelled posts), a second panel
    shows how those probabilities are distributed."""
    title = "Prevalence per question"
    rows = [r for r in rows if _finite(r.get("model_share")) or _finite(r.get("human_share"))]
    if not rows:
        placeholder(path, title, "No question has a model answer or a human label yet.")
        return
    series = [("model (answered posts)", "model_share", "model_lo", "model_hi", "#4c72b0"),
              ("human only", "human_share", "human_lo", "human_hi", "#55a868"),
              ("corrected", "corrected", "corrected_lo", "corrected_hi", "#c44e52")]
    width = max(6.0, 1.6 * len(rows) + 3)
    weighted = sampling_probabilities is not None and np.size(sampling_probabilities) > 0
    if weighted:
        fig, (ax, ax_pi) = plt.subplots(1, 2, figsize=(width + 5, 4.5), gridspec_kw={"width_ratios": [width, 5]})
    else:
        fig, ax = plt.subplots(figsize=(width, 4.5))
    x = np.arange(len(rows))
    offsets = np.linspace(-0.22, 0.22, len(series))
    for (label, key, lo_key, hi_key, color), dx in zip(series, offsets):
        pts = [(i, r[key], r.get(lo_key), r.get(hi_key)) for i, r in enumerate(rows) if _finite(r.get(key))]
        if not pts:
            continue
        xs = np.array([p[0] for p in pts]) + dx
        ys = np.array([p[1] for p in pts])
        lo = np.array([p[2] if _finite(p[2]) else p[1] for p in pts])
        hi = np.array([p[3] if _finite(p[3]) else p[1] for p in pts])
        # matplotlib refuses negative error bars; a bound on the wrong side of the point (rounding
        # at 0 or 1) draws as no bar on that side.
        ax.errorbar(xs, ys, yerr=[np.maximum(ys - lo, 0.0), np.maximum(hi - ys, 0.0)], fmt="o", color=color,
                    capsize=4, label=label)
    ax.set_xticks(x, [r["question"] for r in rows], rotation=20, ha="right")
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share answering yes")
    ax.set_title(f"{title} ({confidence:.0%} intervals)")
    ax.legend(frameon=False, loc="best")
    ax.grid(axis="y", alpha=0.3)
    if weighted:
        pi = np.asarray(sampling_probabilities, dtype=float)
        bins = np.logspace(np.log10(pi.min()), np.log10(pi.max()), 30) if pi.max() > pi.min() else 10
        ax_pi.hist(pi, bins=bins, color="#8172b2", edgecolor="white", linewidth=0.4)
        if pi.max() > pi.min():
            ax_pi.set_xscale("log")
        ax_pi.set_xlabel("sampling probability of a labelled post")
        ax_pi.set_ylabel("labelled posts")
        ax_pi.set_title(f"Sampling probabilities (n = {pi.size:,})")
        ax_pi.grid(axis="y", alpha=0.3)
    _save(fig, path)


def throughput(curves: dict[str, tuple[np.ndarray, np.ndarray]], path: str | Path) -> None:
    """Cumulative completed requests over time, one line per shard. ``curves``: shard -> (minutes, count)."""
    title = "Completed requests over time"
    if not curves:
        placeholder(path, title, "No request has start and finish times yet.")
        return
    fig, ax = plt.subplots(figsize=_SIZE)
    for shard, (minutes, cumulative) in sorted(curves.items(), key=lambda kv: int(kv[0])):
        ax.step(np.concatenate([[0.0], minutes]), np.concatenate([[0], cumulative]), where="post",
                label=f"shard {shard}")
    ax.set_xlabel("minutes since the first request started")
    ax.set_ylabel("completed requests")
    ax.set_title(title)
    if len(curves) <= 12:
        ax.legend(frameon=False, fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)


def errors(rows: Sequence[dict[str, Any]], path: str | Path) -> None:
    """Horizontal bars: count per stage and reason."""
    title = "Errors and exclusions by kind"
    rows = [r for r in rows if r["count"] > 0]
    if not rows:
        placeholder(path, title, "No errors: every post was classified\nand every human label was usable.")
        return
    colors = {"manifest": "#dd8452", "classify": "#c44e52", "human_labels": "#8172b2"}
    fig, ax = plt.subplots(figsize=(7.5, max(2.5, 0.35 * len(rows) + 1.2)))
    labels = [f"{r['stage']}: {r['reason']}" for r in rows][::-1]
    counts = [r["count"] for r in rows][::-1]
    bar_colors = [colors.get(r["stage"], "0.5") for r in rows][::-1]
    bars = ax.barh(labels, counts, color=bar_colors)
    ax.bar_label(bars, labels=[f"{c:,}" for c in counts], padding=3, fontsize=8)
    ax.set_xlabel("count")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    _save(fig, path)


def _finite(value) -> bool:
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)


def prevalence_by_model(rows: Sequence[dict[str, Any]], path: str | Path, confidence: float) -> None:
    """Per question, each model's own share (hollow) and corrected share (filled) with interval bars,
    and the human-only share with its interval as a grey band across the question (the same human
    labels serve every model). ``rows``: one per (model, question) with the columns of
    compare's models.csv as floats."""
    title = "Prevalence per question and model"
    drawn = [r for r in rows if _finite(r.get("model_share")) or _finite(r.get("corrected"))
             or _finite(r.get("human_share"))]
    if not drawn:
        placeholder(path, title, "No model answered any post and no human label is usable:\nnothing to draw.")
        return
    questions = list(dict.fromkeys(r["question"] for r in rows))
    models = list(dict.fromkeys(r["model"] for r in rows))
    colors = plt.get_cmap("tab10")
    width = max(6.0, 1.2 * len(questions) * max(1, len(models)) + 3)
    fig, ax = plt.subplots(figsize=(min(width, 30.0), 4.5))
    slots = np.linspace(-0.35, 0.35, 2 * len(models)) if len(models) > 1 else np.array([-0.1, 0.1])
    human_labelled = False
    for qi, question in enumerate(questions):
        human = next((r for r in rows if r["question"] == question and _finite(r.get("human_share"))), None)
        if human:
            lo, hi = (human[k] if _finite(human.get(k)) else human["human_share"] for k in ("human_lo", "human_hi"))
            ax.fill_between([qi - 0.45, qi + 0.45], lo, hi, color="0.85", zorder=0, linewidth=0)
            ax.hlines(human["human_share"], qi - 0.45, qi + 0.45, color="0.4", linestyle="--", zorder=1,
                      label=None if human_labelled else "human only (band: its interval)")
            human_labelled = True
    for mi, model in enumerate(models):
        color = colors(mi % 10)
        series = (("model_share", "model_lo", "model_hi", "own share (answered posts)", "white"),
                  ("corrected", "corrected_lo", "corrected_hi", "corrected", color))
        for si, (key, lo_key, hi_key, label, face) in enumerate(series):
            pts = [(qi + slots[2 * mi + si], r[key], r.get(lo_key), r.get(hi_key))
                   for qi, q in enumerate(questions) for r in rows
                   if r["question"] == q and r["model"] == model and _finite(r.get(key))]
            if not pts:
                continue
            xs, ys = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
            lo = np.array([p[2] if _finite(p[2]) else p[1] for p in pts])
            hi = np.array([p[3] if _finite(p[3]) else p[1] for p in pts])
            # a bound on the wrong side of its point (rounding at 0 or 1) draws as no bar on that side
            ax.errorbar(xs, ys, yerr=[np.maximum(ys - lo, 0.0), np.maximum(hi - ys, 0.0)], fmt="o", color=color,
                        markerfacecolor=face, capsize=3, label=f"{model}: {label}", zorder=2)
    ax.set_xticks(np.arange(len(questions)), questions, rotation=20, ha="right")
    ax.set_xlim(-0.6, len(questions) - 0.4)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share answering yes")
    ax.set_title(f"{title} ({confidence:.0%} intervals)")
    ax.legend(frameon=False, fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(axis="y", alpha=0.3)
    _save(fig, path)
