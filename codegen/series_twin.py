"""The lambdify twin of a large-depth series program (derive.series), unpacked by output name.

``series_twin(program)(x, params) -> {name: array (n, *shape)}`` with x (n, n_in) the flattened
indices and params the program's runtime parameters (β, ε), in the order of ``program.params``.
"""
from __future__ import annotations

import numpy as np

from derive.program import Program

from .twin import twin


def series_twin(program: Program):
    """Evaluate every output of ``program`` over a batch (NumPy, through :func:`codegen.twin`)."""
    run = twin(program)
    layout = program.layout()

    def evaluate(x: np.ndarray, params) -> dict[str, np.ndarray]:
        out = run(np.asarray(x, dtype=np.float64), np.asarray(params, dtype=np.float64))
        result, start = {}, 0
        for name, shape in layout.items():
            size = int(np.prod(shape))
            result[name] = out[:, start:start + size].reshape(len(out), *shape)
            start += size
        return result

    return evaluate
