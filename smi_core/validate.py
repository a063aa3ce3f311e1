"""Input checks: bad input raises a ValueError naming the argument and the constraint."""
from __future__ import annotations

import numpy as np


def batch(name: str, value, shape: tuple[int, ...]) -> tuple[np.ndarray, bool]:
    """``value`` as a float64 array (n, *shape); a single sample of ``shape`` is accepted too.
    Returns the batch and whether the input was a single sample."""
    arr = np.asarray(value, dtype=np.float64)
    single = arr.shape == shape
    if single:
        arr = arr[None]
    if arr.ndim != len(shape) + 1 or arr.shape[1:] != shape:
        raise ValueError(f"{name} must have shape (n, {', '.join(map(str, shape))}) or "
                         f"{shape}, got {arr.shape}")
    if not np.isfinite(arr).all():
        row = int(np.argmax(~np.isfinite(arr.reshape(len(arr), -1)).all(axis=1)))
        raise ValueError(f"{name} must be finite (sample {row} is not)")
    return np.ascontiguousarray(arr), single


def positive(name: str, value: float, allow_zero: bool = False) -> float:
    value = float(value)
    ok = value >= 0 if allow_zero else value > 0
    if not (ok and np.isfinite(value)):
        raise ValueError(f"{name} must be {'≥ 0' if allow_zero else '> 0'} and finite, got {value}")
    return value


def softmax_range(y: np.ndarray, tol: float = 1e-9) -> tuple[np.ndarray, np.ndarray]:
    """Per sample of y (n, T, T): whether every entry is in (0, 1], and the largest |row sum − 1|
    (the softmax range is both, the latter ≤ tol; see ``softmax_output``)."""
    inside = ((y > 0) & (y <= 1)).reshape(len(y), -1).all(axis=1)
    return inside, np.abs(y.sum(axis=2) - 1).max(axis=1)


def softmax_output(name: str, y: np.ndarray, tol: float = 1e-9) -> None:
    """y (n, T, T) must be row-stochastic with entries in (0, 1].  An entry of exactly 1.0 is
    accepted as the float64 rounding of 1 - tiny (the row's other entries, > 0, still carry the
    log-ratios); an entry ≤ 0 carries no pre-image and is rejected."""
    inside, err = softmax_range(y, tol)
    if not inside.all():
        row = int(np.argmax(~inside))
        raise ValueError(f"{name} must have entries inside (0, 1) (softmax range); sample {row} does not")
    if (err > tol).any():
        row = int(np.argmax(err > tol))
        raise ValueError(f"{name} rows must sum to 1 (softmax range); sample {row} is off by {err[row]:.3g}")
