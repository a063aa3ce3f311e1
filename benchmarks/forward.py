"""Throughput of the forward map g and of g with ∂g/∂Z, one core, compiled kernel vs lambdify
twin.  Target (issue 2): ≥ 5e6 samples/s for g and ≥ 1e6 for g with ∂g/∂Z at L = 2, T = 2.

    python benchmarks/forward.py [--samples N] [--layers L] [--tokens T] [--rank r]
"""
import argparse
import time

import numpy as np

from smi_core import DeepAttention


def best_rate(call, Z, repeats=5):
    call(Z[:100])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call(Z)
        times.append(time.perf_counter() - start)
    return len(Z) / min(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2)
    p.add_argument("--rank", type=int, default=1)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    print(f"deep attention L={a.layers} T={a.tokens} r={a.rank}, {a.samples} samples, one core")
    print(f"{'kernel':18s} {'backend':9s} {'samples/s':>12s} {'ns/sample':>10s} {'max rel diff vs twin':>21s}")
    results = {}
    Z = rng.standard_normal((a.samples, a.layers * a.rank, a.tokens))
    for backend in ("compiled", "twin"):
        model = DeepAttention(a.layers, a.tokens, a.rank, backend=backend, threads=1)
        for kind, call in (("g", model.forward), ("g + dg/dZ", model.forward_jacobian)):
            results[kind, backend] = (best_rate(call, Z), call(Z[:1000]))
    for (kind, backend), (rate, sample) in results.items():
        ref = results[kind, "twin"][1]
        diff = np.max(np.abs(sample - ref) / np.maximum(np.abs(ref), 1e-300))
        print(f"{kind:18s} {backend:9s} {rate:12.3e} {1e9 / rate:10.1f} {diff:21.1e}")


if __name__ == "__main__":
    main()
