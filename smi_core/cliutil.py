"""Pieces shared by the ``smi`` sub-commands: model options, tables, α grids, CSV."""
from __future__ import annotations

import argparse

import numpy as np

from .models import DeepAttention


def model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=2, help="depth L (default 2)")
    p.add_argument("--tokens", type=int, default=2, help="sequence length T (default 2)")
    p.add_argument("--rank", type=int, default=1, help="rank r per layer (default 1)")
    p.add_argument("--skip", type=float, default=1.0, help="skip strength c (default 1)")
    p.add_argument("--beta", type=float, default=1.0, help="inverse temperature β (default 1)")
    p.add_argument("--architecture", default="tied", help="tied | untied | multihead | seq2seq")
    p.add_argument("--link", default="softmax", help="last-layer activation: softmax | hardmax | linear")


def build_model(a) -> DeepAttention:
    return DeepAttention(layers=a.layers, tokens=a.tokens, rank=a.rank, skip=a.skip, beta=a.beta,
                         architecture=a.architecture, link=a.link)


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    cells = [[f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows]
    width = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, width))
    return "\n".join([line(keys), line(["-" * w for w in width])] + [line(c) for c in cells])


def alphas(text: str) -> np.ndarray:
    """"a:b:n" (n values from a to b) or a comma-separated list."""
    try:
        if ":" in text:
            lo, hi, n = text.split(":")
            return np.linspace(float(lo), float(hi), int(n))
        return np.array([float(v) for v in text.split(",")])
    except ValueError:
        raise ValueError(f"--alphas must be 'start:stop:count' or a comma-separated list, got {text!r}") from None


def write_csv(path: str, rows: list[dict]) -> None:
    import csv
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
