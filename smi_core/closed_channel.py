"""Route 3, ``"closed"``: channels SymPy integrates itself (derive.closed), no quadrature."""
from __future__ import annotations

import numpy as np

from . import validate
from .channels import Moments
from .kernels import first_bad_row


class ClosedChannel:
    """Route 3: a closed form derived by SymPy (derive.closed) for a one-index link applied to
    each token alone (T = 1, or y_t = g(h_t) with one shared weight vector: the channel is the
    product over tokens): affine links with Gaussian noise; without noise sign(z) and even
    links with two pre-images ±r(y) (phase retrieval z², |z|).  No quadrature, ``error`` = 0."""

    route = "closed"
    escalates = error_estimate = ridges = unresolved = False     # exact: no estimate to compute

    def __init__(self, model, noise: float | None = None, threads: int | None = None):
        from derive.closed import closed_form_program, support, token_wise
        from derive.registry import KernelSpec
        from .kernels import Kernel
        link = model.link
        g = token_wise(link.expr, link.tokens) if link.indices == 1 else None
        if g is None:
            raise ValueError(f"route='closed' needs one index (R = 1) and a link applied to each token "
                             f"alone; {link.name!r} has R = {link.indices}, T = {link.tokens}")
        self.model, self.R, self.T = model, 1, link.tokens
        self.params = model.params if noise is None else np.append(model.params, validate.positive("noise", noise))
        name = f"{link.key}_{'noisy' if noise is not None else 'noiseless'}"
        program = closed_form_program(name, g, link.params, noisy=noise is not None)
        if program is None:
            raise ValueError(f"link {link.name!r} has no elementary closed-form channel "
                             f"({'noisy' if noise is not None else 'noiseless'}); use route='noisy'")
        self.support = support(g, noisy=noise is not None)
        spec = KernelSpec(program.name, program.name, lambda: program)
        self._kernel = Kernel(spec, model.backend, threads=threads or 0)

    def _inside(self, y: np.ndarray) -> np.ndarray:
        return {"sign": np.abs(y) == 1, "positive": y > 0, "real": np.isfinite(y)}[self.support]

    def representable(self, y) -> np.ndarray:
        """(n,) mask of the outputs in the link's range."""
        y = np.asarray(y, dtype=np.float64)
        return self._inside(y.reshape(len(y), -1)).all(axis=1)

    def moments(self, y, omega, V) -> Moments:
        omega, _ = validate.batch("omega", omega, (1, self.T))
        n, T = len(omega), self.T
        y = np.asarray(y, dtype=np.float64).reshape(-1)
        if y.shape != (n * T,) or not np.isfinite(y).all():
            raise ValueError(f"y must hold {n}×{T} finite outputs, got shape {np.shape(y)}")
        outside = ~self._inside(y)
        if outside.any():
            raise ValueError(f"y must be {'±1' if self.support == 'sign' else '> 0'} for link "
                             f"{self.model.link.name!r} (sample {int(np.argmax(outside)) // T} has {y[outside][0]})")
        V = np.broadcast_to(np.asarray(V, dtype=np.float64).reshape(-1), (n,)) if np.size(V) in (1, n) else None
        if V is None or not (V > 0).all():
            raise ValueError("V must be positive (a (1, 1) matrix or one per sample)")
        out = self._kernel(np.stack([y, omega.reshape(n * T), np.repeat(V, T)], axis=1), self.params)
        bad = first_bad_row(out)
        if bad is not None:
            raise FloatingPointError(f"non-finite channel moment at sample {bad // T} (closed route)")
        out = out.reshape(n, T, 3)
        dg_out = np.zeros((n, T, T))
        dg_out[:, np.arange(T), np.arange(T)] = out[:, :, 2]
        return Moments(log_z=out[:, :, 0].sum(axis=1), g_out=out[:, :, 1].reshape(n, 1, T),
                       dg_out=dg_out, error=np.zeros(n))
