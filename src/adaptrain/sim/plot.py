"""Plots of simulation results: JCT CDF per policy and allocated GPUs over time."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .simulator import SimResult

__all__ = ["cdf_points", "make_figure", "plot_results"]


def plot_results(results: Mapping[str, SimResult], path: str, gpus: int | None = None) -> None:
    """Write a two-panel PNG: JCT CDFs (log x) and GPUs in use / jobs running over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = make_figure(results, gpus)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cdf_points(jcts) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of the empirical CDF of ``jcts`` as a post-step curve starting at (first JCT, 0):
    with one job it is a visible step at its JCT, not a single point."""
    x = np.sort(np.asarray(list(jcts), dtype=float))
    if not x.size:
        return x, x.copy()
    y = np.arange(1, x.size + 1) / x.size
    return np.concatenate([x[:1], x]), np.concatenate([[0.0], y])


def make_figure(results: Mapping[str, SimResult], gpus: int | None = None):
    """The figure :func:`plot_results` writes (the caller closes it). Allocations are drawn as
    post-steps: a round's allocation holds until the next round."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, res in results.items():
        x, y = cdf_points(res.jcts.values())
        if x.size:
            mean = float(np.mean(list(res.jcts.values())))
            ax1.step(x, y, where="post", label=f"{name} (avg {mean:.0f} s)")
        if res.timeline:
            t = np.array([p["time"] for p in res.timeline]) / 3600.0
            used = np.array([sum(p["allocations"].values()) for p in res.timeline])
            running = np.array([len(p["allocations"]) for p in res.timeline])
            (line,) = ax2.plot(t, used, drawstyle="steps-post", label=f"{name}: GPUs in use")
            ax2.plot(
                t,
                running,
                ls=":",
                drawstyle="steps-post",
                color=line.get_color(),
                label=f"{name}: jobs running",
            )
    ax1.set_xscale("log")
    ax1.set_xlabel("job completion time (s)")
    ax1.set_ylabel("fraction of jobs")
    ax1.set_title("JCT CDF")
    ax1.grid(alpha=0.3)
    if any(r.jcts for r in results.values()):
        ax1.legend(loc="lower right", fontsize=8)
    if gpus:
        ax2.axhline(gpus, color="grey", lw=0.8, ls="--")
    ax2.set_xlabel("simulated time (h)")
    ax2.set_ylabel("count")
    ax2.set_title("allocations over time")
    ax2.grid(alpha=0.3)
    if any(r.timeline for r in results.values()):
        ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return fig
