"""Attention-indexed models: time of a full state-evolution curve (64 values of α) for softmax and
hardmax, mmse(Δ) evaluations per second, and GAMP-RIE at d = 100 per iteration.  Prints a table."""
from __future__ import annotations

import time

import numpy as np

from smi_core.aim import aim_data, aim_free_convolution, aim_gamp, aim_state_evolution
from smi_core.cliutil import table


def main() -> None:
    rows = []
    for channel, hi in (("softmax", 0.3), ("hardmax", 1.5)):
        start = time.perf_counter()
        r = aim_state_evolution(channel, 2, 0.5, np.linspace(0.005, hi, 64))
        rows.append({"task": f"SE curve, 64 α, {channel} T=2 ρ=0.5", "seconds": time.perf_counter() - start,
                     "rate": f"{r.iterations.sum()} iterations, {int(r.converged.sum())}/64 converged"})
    deltas = np.logspace(-6, 6, 200)
    start = time.perf_counter()
    for dl in deltas:
        aim_free_convolution(0.5, dl).mmse
    seconds = time.perf_counter() - start
    rows.append({"task": "mmse(Δ), ρ=0.5, Δ in [1e-6, 1e6]", "seconds": seconds,
                 "rate": f"{len(deltas) / seconds:.0f} evaluations/s"})
    for channel, alpha in (("softmax", 0.15), ("hardmax", 0.5)):
        data = aim_data(100, alpha, 0.5, 2, channel, seed=0)
        start = time.perf_counter()
        g = aim_gamp(data, max_iter=20, tol=0)
        seconds = time.perf_counter() - start
        rows.append({"task": f"GAMP-RIE d=100, {channel} α={alpha} (n={data.X.shape[0]})", "seconds": seconds,
                     "rate": f"{seconds / g.iterations * 1e3:.0f} ms/iteration"})
    print(table(rows))


if __name__ == "__main__":
    main()
