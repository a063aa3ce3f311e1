"""GAMP on data (issue 6): wall time per iteration and the final overlaps against state evolution.

Two-layer attention (T = 2, r = 1, c = 1, β = 1) at α = 1.2: D = 1000 (n = 1200), 50 iterations,
target ≤ 60 s on 2 cores; and D = 10⁴ (n = 12 000; X alone is 1.9 GB).  One teacher per D.

    python benchmarks/gamp.py [--dims 1000,10000] [--iterations 50] [--threads 2] [--se-samples N]
"""
import argparse
import time

import numpy as np

from smi_core import DeepAttention, state_evolution
from smi_core.data import make_teacher, sample
from smi_core.gamp import gamp


def run(model, dim: int, alpha: float, iterations: int, threads: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    teacher = make_teacher(model, dim, rng)
    X, y = sample(teacher, int(round(alpha * dim)), rng)
    data = time.perf_counter() - start
    wall, cpu = time.perf_counter(), time.process_time()
    r = gamp(model, X, y, teacher=teacher, rng=rng, max_iter=iterations, tol=1e-300,
             channel={"threads": threads})
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"D": dim, "n": len(X), "data_s": data, "gamp_s": wall, "cpu_s": cpu,
            "per_iter_s": wall / r.iterations, "iterations": r.iterations,
            "M": np.abs(np.diag(r.overlap[-1])), "cos": r.cosine[-1], "test_error": r.test_error[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="1000,10000")
    p.add_argument("--alpha", type=float, default=1.2)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--se-samples", type=int, default=4096)
    a = p.parse_args()
    model = DeepAttention(layers=2, tokens=2)
    se = state_evolution(model, a.alpha, samples=a.se_samples, channel={"threads": a.threads})
    q = np.diag(se.q)
    print(f"{model!r}, α = {a.alpha}: state evolution q = {np.round(q, 4).tolist()} "
          f"(± {np.round(np.diag(se.q_stderr), 4).tolist()}), prediction error {se.prediction_error:.2e}")
    print("\n     D       n  data s  GAMP s  CPU s  s/iter  iters  target   |M_11|  |M_22|  cos_1   cos_2   "
          "test error")
    for dim in (int(v) for v in a.dims.split(",")):
        r = run(model, dim, a.alpha, a.iterations, a.threads, a.seed)
        target = "≤ 60 s" if dim == 1000 else "-"
        print(f"{r['D']:6d}  {r['n']:6d}  {r['data_s']:6.1f}  {r['gamp_s']:6.1f}  {r['cpu_s']:5.0f}  "
              f"{r['per_iter_s']:6.2f}  {r['iterations']:5d}  {target:7s}  {r['M'][0]:6.4f}  {r['M'][1]:6.4f}  "
              f"{r['cos'][0]:6.4f}  {r['cos'][1]:6.4f}  {r['test_error']:.2e}", flush=True)


if __name__ == "__main__":
    main()
