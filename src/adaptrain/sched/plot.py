"""Plots of simulation results: JCT CDF per policy and allocated GPUs over time."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .simulator import SimResult

__all__ = ["plot_results"]


def plot_results(results: Mapping[str, SimResult], path: str, gpus: int | None = None) -> None:
    """Write a two-panel PNG: JCT CDFs (log x) and GPUs in use / jobs running over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, res in results.items():
        jcts = np.sort(np.fromiter(res.jcts.values(), dtype=float))
        if jcts.size:
            cdf = np.arange(1, jcts.size + 1) / jcts.size
            ax1.step(jcts, cdf, where="post", label=f"{name} (avg {jcts.mean():.0f} s)")
        if res.timeline:
            t = np.array([p["time"] for p in res.timeline]) / 3600.0
            used = np.array([sum(p["allocations"].values()) for p in res.timeline])
            running = np.array([len(p["allocations"]) for p in res.timeline])
            (line,) = ax2.plot(t, used, label=f"{name}: GPUs in use")
            ax2.plot(t, running, ls=":", color=line.get_color(), label=f"{name}: jobs running")
    ax1.set_xscale("log")
    ax1.set_xlabel("job completion time (s)")
    ax1.set_ylabel("fraction of jobs")
    ax1.set_title("JCT CDF")
    ax1.grid(alpha=0.3)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
