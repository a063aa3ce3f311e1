"""The large-depth series of deep attention (spec §3), evaluated numerically.

Rescaled model (ε = 1/c), h_ℓ the r×T block of layer ℓ (zero-based ℓ = 0 … L-1):

    Φ⁽ℓ⁾ = (I + ε σ_β(u_ℓ u_ℓᵀ)) Φ⁽ℓ⁻¹⁾,  u_ℓ = Φ⁽ℓ⁻¹⁾ h_ℓᵀ,   M = u_L u_Lᵀ,   y = s(M)

    Φ⁽ᴸ⁻¹⁾ = Φ₀ + εΦ₁ + ε²Φ₂ + O(ε³),   M = M₀ + εM₁ + ε²M₂ + O(ε³)

with Φ₀ = I, Φ₁ = Σ_{ℓ<L-1} σ_β(h_ℓᵀh_ℓ), M₀ = h_Lᵀh_L, M₁ = Φ₁M₀ + M₀Φ₁ᵀ.  The coefficient
matrices come from the symbolic derivation :func:`derive.series.large_depth_series`, evaluated by its
lambdify twin (:func:`codegen.series_twin.series_twin`); nothing model-specific is written here.

What :meth:`LargeDepthSeries.evaluate` reports (all norms Frobenius, per sample):

- ``phi_first_order`` = Φ₀ + εΦ₁ and ``phi_bound`` = ε²‖Φ₂‖_F, the leading term of the remainder:
  ‖Φ⁽ᴸ⁻¹⁾(ε) - Φ₀ - εΦ₁‖_F = ε²‖Φ₂‖_F + O(ε³).
- ``logits_first_order`` = M₀ + εM₁ and ``logit_bound`` = ε²‖M₂‖_F, likewise for the logits.
- ``y_first_order`` = s(M₀ + εM₁) (the first-order model: the last-layer link applied to the
  first-order logits) and ``y_bound`` = Lip(s) · ε²‖M₂‖_F.  Since s is globally Lipschitz,
  ‖y(ε) - s(M₀+εM₁)‖_F ≤ Lip(s) ‖M(ε) - M₀ - εM₁‖_F = Lip(s) (ε²‖M₂‖_F + O(ε³)) holds exactly;
  ``y_bound`` is the leading term of that right-hand side (the O(ε³) part is not included, so it is
  an asymptotic bound, valid as ε → 0).  Lip(s) = β/2 for the row-wise softmax σ_β (its Jacobian
  β(diag p - ppᵀ) has vᵀJv = β Var_p(v) ≤ β (max v - min v)²/4 ≤ β‖v‖²/2) and 1 for the linear link.
- ``y_error_estimate`` = ε²‖Ds(M₀)[M₂]‖_F, the leading term of the actual error
  ‖y(ε) - s(M₀+εM₁)‖_F (≤ ``y_bound``).

:meth:`LargeDepthSeries.exact` evaluates the exact rescaled model with the original
:class:`~smi_core.models.DeepAttention` (skip c = 1/ε) on the rescaled indices h_ℓ ε^ℓ (every layer):
then the original's u_ℓ equals the rescaled u_ℓ, its Φ⁽ℓ⁾ is c^ℓ times the rescaled Φ⁽ℓ⁾, and its
output and last-layer logits equal the rescaled model's.  (Scaling only the last layer, h_L/c^{L-1},
is enough for L = 2 but not for L ≥ 3: layer ℓ ≥ 1 of the original reads the stream Φ⁽ℓ⁻¹⁾ ∝ c^ℓ, so
its logits would be c^{2ℓ} too large.)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from codegen.series_twin import series_twin
from derive.attention import AttentionSpec
from derive.registry import attention_kernels
from derive.series import SERIES_LINKS, large_depth_series

from . import validate
from .kernels import first_bad_row, pregenerated
from .models import DeepAttention

SERIES_BACKENDS = ("auto", "compiled", "twin")


@dataclass
class SeriesEvaluation:
    """The first-order large-depth model and its ε² error terms; see the module docstring.
    Arrays have a leading sample axis n (dropped for a single (R, T) input)."""

    eps: float
    phi_first_order: np.ndarray      # (n, T, T)  Φ₀ + εΦ₁
    phi_bound: np.ndarray            # (n,)       ε² ‖Φ₂‖_F
    logits_first_order: np.ndarray   # (n, T, T)  M₀ + εM₁
    logit_bound: np.ndarray          # (n,)       ε² ‖M₂‖_F
    y_first_order: np.ndarray        # (n, T, T)  s(M₀ + εM₁)
    y_bound: np.ndarray              # (n,)       Lip(s) ε² ‖M₂‖_F
    y_error_estimate: np.ndarray     # (n,)       ε² ‖Ds(M₀)[M₂]‖_F
    lipschitz: float                 # Lip(s): β/2 (softmax) or 1 (linear)
    coefficients: dict = field(repr=False)   # phi0 phi1 phi2 M0 M1 M2 y0 y1 y2 dy2: (n, T, T)


@dataclass
class ExactEvaluation:
    """The exact rescaled deep model at ε."""

    eps: float
    phi: np.ndarray       # (n, T, T)  rescaled Φ⁽ᴸ⁻¹⁾ = original Φ⁽ᴸ⁻¹⁾ / c^{L-1}
    logits: np.ndarray    # (n, T, T)  M = u_L u_Lᵀ
    y: np.ndarray         # (n, T, T)  s(M)


class LargeDepthSeries:
    """Large-depth series of tied deep attention with L ``layers``, T ``tokens``, rank r, inverse
    temperature β and last-layer link s (``"softmax"`` = σ_β, or ``"linear"``).

    ``backend`` is used by :meth:`exact` for the DeepAttention kernels: ``"auto"`` uses the
    committed compiled kernels where they exist and the lambdify twin otherwise (no compilation
    on demand); ``"compiled"`` / ``"twin"`` force one.  The series itself is always evaluated
    by the lambdify twin of the derived program."""

    def __init__(self, layers: int, tokens: int, rank: int = 1, beta: float = 1.0,
                 link: str = "softmax", backend: str = "auto"):
        if link not in SERIES_LINKS:
            raise ValueError(f"link must be one of {SERIES_LINKS}, got {link!r}")
        self.spec = AttentionSpec(layers, tokens, rank, link=link)      # validates L, T, r
        if backend not in SERIES_BACKENDS:
            raise ValueError(f"backend must be one of {SERIES_BACKENDS}, got {backend!r}")
        self.layers, self.tokens, self.rank, self.link = layers, tokens, rank, link
        self.beta = validate.positive("beta", beta)
        self.backend = backend
        self.indices = layers * rank
        self.lipschitz = self.beta / 2 if link == "softmax" else 1.0
        self._series = None
        self._twin = None

    def __repr__(self):
        return (f"LargeDepthSeries(layers={self.layers}, tokens={self.tokens}, rank={self.rank}, "
                f"beta={self.beta}, link={self.link!r})")

    @property
    def series(self):
        """The symbolic derivation (:class:`derive.series.DepthSeries`), built on first use."""
        if self._series is None:
            self._series = large_depth_series(self.layers, self.tokens, self.rank, self.link)
        return self._series

    def coefficients(self, Z, eps: float = 0.0) -> dict[str, np.ndarray]:
        """Every output of the derived program at Z (n, R, T): ``phi0..2``, ``M0..2``, ``y0..2``,
        ``dy2`` and ``y_first`` = s(M₀ + εM₁), each (n, T, T)."""
        Z, _ = validate.batch("Z", Z, (self.indices, self.tokens))
        if self._twin is None:
            self._twin = series_twin(self.series.program)
        out = self._twin(Z.reshape(len(Z), -1), [self.beta, eps])
        bad = first_bad_row(np.concatenate([v.reshape(len(Z), -1) for v in out.values()], axis=1))
        if bad is not None:
            raise ValueError(f"the series is not finite at sample {bad} of Z")
        return out

    def evaluate(self, Z, eps: float) -> SeriesEvaluation:
        """The first-order model at ε and its ε² terms (see the module docstring)."""
        eps = validate.positive("eps", eps, allow_zero=True)
        single = np.shape(Z) == (self.indices, self.tokens)
        c = self.coefficients(Z, eps)
        norm = lambda a: np.linalg.norm(a, axis=(1, 2))
        logit_bound = eps ** 2 * norm(c["M2"])
        result = SeriesEvaluation(
            eps=eps,
            phi_first_order=c["phi0"] + eps * c["phi1"],
            phi_bound=eps ** 2 * norm(c["phi2"]),
            logits_first_order=c["M0"] + eps * c["M1"],
            logit_bound=logit_bound,
            y_first_order=c.pop("y_first"),
            y_bound=self.lipschitz * logit_bound,
            y_error_estimate=eps ** 2 * norm(c["dy2"]),
            lipschitz=self.lipschitz,
            coefficients=c)
        return _squeeze(result, single)

    # -- the exact rescaled model ----------------------------------------------------------------
    def rescale(self, Z, eps: float) -> np.ndarray:
        """The original model's indices: block ℓ (zero-based) of Z times ε^ℓ = c^{-ℓ}."""
        Z, _ = validate.batch("Z", Z, (self.indices, self.tokens))
        scale = np.repeat(float(eps) ** np.arange(self.layers), self.rank)
        return Z * scale[None, :, None]

    def model(self, eps: float, link: str | None = None) -> DeepAttention:
        """The original DeepAttention with skip c = 1/ε (link defaults to this series' link)."""
        eps = validate.positive("eps", eps)
        link = link or self.link
        spec = AttentionSpec(self.layers, self.tokens, self.rank, link=link)
        backend = self.backend
        if backend == "auto":
            committed = pregenerated()
            wanted = [k for kind, k in attention_kernels(spec).items() if kind in ("forward", "mixing")]
            backend = "compiled" if all(k.name in committed for k in wanted) else "twin"
        return DeepAttention(self.layers, self.tokens, self.rank, skip=1.0 / eps, beta=self.beta,
                             link=link, backend=backend)

    def exact(self, Z, eps: float) -> ExactEvaluation:
        """The exact rescaled deep model at ε: Φ⁽ᴸ⁻¹⁾, the last-layer logits and y."""
        eps = validate.positive("eps", eps)
        single = np.shape(Z) == (self.indices, self.tokens)
        Zr = self.rescale(Z, eps)
        T, L = self.tokens, self.layers
        logits = self.model(eps, "linear").forward(Zr)
        y = logits if self.link == "linear" else self.model(eps).forward(Zr)
        if L >= 2:
            phi = self.model(eps).mixing(Zr).phi * eps ** (L - 1)
        else:
            phi = np.broadcast_to(np.eye(T), (len(Zr), T, T)).copy()
        return _squeeze(ExactEvaluation(eps=eps, phi=phi, logits=logits, y=y), single)


def _squeeze(result, single: bool):
    if single:
        for name, value in vars(result).items():
            if isinstance(value, np.ndarray):
                setattr(result, name, value[0])
            elif isinstance(value, dict):
                setattr(result, name, {k: v[0] for k, v in value.items()})
    return result
