"""Models: a deep-attention network or a registered link, as an SMI model y = g(H).

Structural choices pick the kernels; continuous parameters (skip c, inverse temperature β,
readout weights, a link's own parameters) are passed to the kernels at run time.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from itertools import product

import numpy as np

from derive.attention import AttentionSpec
from derive.registry import LinkSpec, attention_kernels, link_kernels

from . import validate
from .kernels import BACKENDS, Kernel, first_bad_row


class SMIModel:
    """Common interface: ``forward(Z)`` and ``forward_jacobian(Z)`` for Z of shape (n, R, T)."""

    indices: int          # R
    tokens: int           # T
    output_shape: tuple[int, ...]

    def __init__(self, kernels: dict, params: np.ndarray, backend: str, threads: int | None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.params = np.asarray(params, dtype=np.float64)
        self.backend = backend
        self._specs = kernels
        self._threads = threads or 0
        self._kernels: dict[str, Kernel] = {}

    def kernel(self, kind: str, threads: int | None = None) -> Kernel:
        """The kernel ``kind`` (forward, jacobian, mixing, reparam), loaded on first use; with
        ``threads`` other than the model's, a copy on those threads (the channels pass theirs:
        on the model's, ``channel(threads=1)`` filled the polar rule's node data on every core)."""
        if kind not in self._specs:
            raise ValueError(f"{self!r} has no {kind!r} kernel (it has {sorted(self._specs)})")
        if kind not in self._kernels:
            self._kernels[kind] = Kernel(self._specs[kind], self.backend,
                                         siblings=tuple(self._specs.values()), threads=self._threads)
        kernel = self._kernels[kind]
        if threads and threads != kernel.threads:
            kernel = copy.copy(kernel)
            kernel.threads = threads
        return kernel

    def channel(self, route: str | None = None, noise: float | None = None, **options):
        """The output channel (spec §4): ``channel.moments(y, omega, V)`` gives log Z_out, g_out
        and ∂_ω g_out.  ``noise`` = Δ > 0 selects the noisy route; options: ``nodes`` (per
        dimension), ``tol``, ``error_estimate``, ``threads``, and ``escalate`` (the estimate
        above which a two-layer sample gets finer rules, on route 1 and on the noisy route below
        its POLAR_MIN_NOISE; see smi_core.channels)."""
        from .channels import make_channel
        return make_channel(self, route=route, noise=noise, **options)

    def symmetries(self) -> np.ndarray:
        """Row sign patterns (S, R) that leave g unchanged; used to start the mode search."""
        return np.array([np.ones(self.indices), -np.ones(self.indices)])

    def _indices(self, Z, name="Z"):
        return validate.batch(name, Z, (self.indices, self.tokens))

    def forward(self, Z) -> np.ndarray:
        """y = g(Z), shape (n, *output_shape); a single (R, T) sample gives one output."""
        Z, single = self._indices(Z)
        y = self.kernel("forward")(Z.reshape(len(Z), -1), self.params).reshape(len(Z), *self.output_shape)
        return y[0] if single else y

    def forward_jacobian(self, Z) -> np.ndarray:
        """∂y/∂Z, shape (n, size(y), R*T), both sides flattened row-major (Z[a, t] ↦ a*T + t)."""
        Z, single = self._indices(Z)
        out = self.kernel("jacobian")(Z.reshape(len(Z), -1), self.params)
        J = out[:, int(np.prod(self.output_shape)):].reshape(len(Z), -1, self.indices * self.tokens)
        return J[0] if single else J


class DeepAttention(SMIModel):
    """Deep attention with low-rank weights (spec §2): L layers, T tokens, rank r, skip c,
    inverse temperature β.  ``link`` is the last layer's activation (softmax, hardmax, linear)."""

    def __init__(self, layers: int = 2, tokens: int = 2, rank: int = 1, skip: float = 1.0,
                 beta: float = 1.0, architecture: str = "tied", link: str = "softmax",
                 heads: int = 1, readout=None, backend: str = "compiled", threads: int | None = None):
        self.spec = AttentionSpec(layers, tokens, rank, architecture, link, heads)
        self.skip = validate.positive("skip", skip, allow_zero=True)
        self.beta = validate.positive("beta", beta)
        params = [self.skip, self.beta]
        if architecture == "multihead":
            readout = np.full((layers, heads), 1.0 / heads) if readout is None else np.asarray(readout, float)
            if readout.shape != (layers, heads) or not np.isfinite(readout).all():
                raise ValueError(f"readout must be a finite ({layers}, {heads}) array, got shape {readout.shape}")
            params += list(readout.ravel())
        elif readout is not None:
            raise ValueError("readout is only used with architecture='multihead'")
        self.readout = readout
        self.layers, self.tokens, self.rank = layers, tokens, rank
        self.indices = self.spec.indices
        self.output_shape = (tokens, tokens)
        super().__init__(attention_kernels(self.spec), params, backend, threads)

    def replace(self, **changes) -> "DeepAttention":
        """The same model with some constructor arguments changed, e.g. ``replace(skip=0.5)``."""
        s = self.spec
        args = dict(layers=s.layers, tokens=s.tokens, rank=s.rank, skip=self.skip, beta=self.beta,
                    architecture=s.architecture, link=s.link, heads=s.heads, readout=self.readout,
                    backend=self.backend, threads=self._threads)
        return DeepAttention(**(args | changes))

    def __repr__(self):
        s = self.spec
        return (f"DeepAttention(layers={s.layers}, tokens={s.tokens}, rank={s.rank}, skip={self.skip}, "
                f"beta={self.beta}, architecture={s.architecture!r}, link={s.link!r})")

    def symmetries(self) -> np.ndarray:
        """The model is even in every layer: all 2^L sign patterns of the layers' rows."""
        width = self.spec.rows_per_layer
        return np.array([np.repeat(p, width) for p in product((1.0, -1.0), repeat=self.layers)])

    def mixing(self, H) -> "Mixing":
        """Φ⁽ᴸ⁻¹⁾ (n, T, T) and log|det Φ⁽ᴸ⁻¹⁾| (n,) from the earlier layers' indices h_{<L}:
        H of shape (n, (L-1)·rows, T), or the full (n, R, T) (its last layer is ignored)."""
        rows = (self.layers - 1) * self.spec.rows_per_layer
        H = np.asarray(H, dtype=np.float64)
        if H.ndim == 3 and H.shape[1] == self.indices and rows != self.indices:
            H = H[:, :rows]
        H, _ = validate.batch("H", H, (rows, self.tokens))
        out = self.kernel("mixing")(H.reshape(len(H), -1), self.params)
        T = self.tokens
        return Mixing(phi=out[:, :T * T].reshape(-1, T, T), logdet=out[:, T * T])

    def reparametrise(self, y, h_prev=None, tol: float = 1e-7) -> "Reparametrisation":
        """The pre-images (±u_L, ±h_L) of a softmax output y given the earlier indices h_{<L}
        (spec §4, r = 1): u_L from the log-ratios of y, h_L = (Φ⁽ᴸ⁻¹⁾)⁻¹ u_L, log|det Φ⁽ᴸ⁻¹⁾|.
        Raises ValueError for y outside the softmax range or with no consistent pre-image."""
        T, L = self.tokens, self.layers
        kernel = self.kernel("reparam")     # before the shape checks, which assume r = 1
        y, _ = validate.batch("y", y, (T, T))
        validate.softmax_output("y", y)
        h_prev = np.zeros((len(y), 0, T)) if L == 1 and h_prev is None else h_prev
        if h_prev is None:
            raise ValueError(f"h_prev (the first {L - 1} layers' indices) is required for layers={L}")
        h_prev, _ = validate.batch("h_prev", h_prev, (L - 1, T))
        if len(h_prev) != len(y):
            raise ValueError(f"y and h_prev must have the same number of samples, got {len(y)} and {len(h_prev)}")
        x = np.concatenate([y.reshape(len(y), -1), h_prev.reshape(len(y), -1)], axis=1)
        out = kernel(x, self.params)
        u, h, logdet = out[:, :T], out[:, T:2 * T], out[:, 2 * T]
        consistent = self._consistent(y, out, tol)
        if not consistent.all():
            bad = int(np.argmin(consistent))
            raise ValueError(f"y has no consistent pre-image σ_β(u uᵀ) (sample {bad}): its log-ratios "
                             "log(y_ts/y_tt) are not of the form β u_t (u_s - u_t)")
        bad = first_bad_row(h)
        if bad is not None:
            raise ValueError(f"h_prev gives a singular mixing matrix Φ⁽ᴸ⁻¹⁾ (sample {bad}): "
                             "h_L = (Φ⁽ᴸ⁻¹⁾)⁻¹ u_L is not finite")
        return Reparametrisation(u=u, h=h, logdet=logdet)

    def has_preimage(self, y, tol: float = 1e-7) -> np.ndarray:
        """(n,) mask of the softmax outputs y whose last-layer pre-image ±u_L is determined in
        float64 (``reparametrise`` accepts them).  Besides outputs outside the model's range,
        it excludes those rounding has made ambiguous: for T = 2, u = ±(a, −b)/√(a + b) with
        a + b = (u₁ − u₂)², which cancels to nothing when u₁ ≈ u₂ (both rows of y within ≈ 1e-8
        of ½ ± the same amount)."""
        T, L = self.tokens, self.layers
        y = np.asarray(y, dtype=np.float64)
        inside, err = validate.softmax_range(y)
        inside &= err <= 1e-9
        y = np.where(inside[:, None, None], y, 1.0 / T)        # the kernel sees only valid rows
        x = np.concatenate([y.reshape(len(y), -1), np.zeros((len(y), (L - 1) * T))], axis=1)
        return inside & self._consistent(y, self.kernel("reparam")(x, self.params), tol)

    @staticmethod
    def _consistent(y, out, tol):
        """The reparametrisation kernel's u finite and its residuals (the log-ratios of y that
        u does not reproduce) within tol of the largest log-ratio (at least 1)."""
        T = y.shape[-1]
        resid = out[:, 2 * T + 1:]
        logratio = np.abs(np.log(y)).reshape(len(y), -1).max(axis=1)
        finite = np.isfinite(out[:, :T]).all(axis=1)
        return finite & (np.abs(resid).max(axis=1, initial=0.0) <= tol * np.maximum(1.0, logratio))


@dataclass
class Mixing:
    phi: np.ndarray       # (n, T, T)
    logdet: np.ndarray    # (n,)


@dataclass
class Reparametrisation:
    """The + pre-image; the other is (-u, -h).  ``logdet`` = log|det Φ⁽ᴸ⁻¹⁾|."""
    u: np.ndarray         # (n, T)
    h: np.ndarray         # (n, T)
    logdet: np.ndarray    # (n,)


# -- user-defined links -------------------------------------------------------------------------

_LINKS: dict[str, LinkSpec] = {}


def register_link(name: str, expr=None, *, indices: int | None = None, tokens: int | None = None,
                  params=()):
    """Register a link y = g(H) given as a SymPy expression (scalar or matrix) in the symbols
    ``derive.index_symbols(indices, tokens)`` and the SymPy symbols ``params``.  As a decorator
    (``expr`` omitted) it registers ``f(H, *params) -> expr``.  Returns the LinkSpec."""
    if expr is None:
        return lambda f: register_link(name, f, indices=indices, tokens=tokens, params=params)
    from derive.registry import make_link
    link = make_link(name, expr, indices=indices, tokens=tokens, params=params)
    _LINKS[name] = link
    return link


class LinkModel(SMIModel):
    """A registered link as a model: ``LinkModel(name, **parameter_values)``."""

    def __init__(self, name: str, backend: str = "compiled", threads: int | None = None, **values):
        if name not in _LINKS:
            raise ValueError(f"link {name!r} is not registered (registered: {sorted(_LINKS)})")
        link = self.link = _LINKS[name]
        names = [str(p) for p in link.params]
        missing, extra = set(names) - set(values), set(values) - set(names)
        if missing or extra:
            raise ValueError(f"link {name!r} takes parameters {names}; missing {sorted(missing)}, "
                             f"unknown {sorted(extra)}")
        self.indices, self.tokens = link.indices, link.tokens
        shape = link.expr.shape
        self.output_shape = () if shape == (1, 1) else tuple(shape)
        super().__init__(link_kernels(link), [float(values[p]) for p in names], backend, threads)

    def __repr__(self):
        return f"LinkModel({self.link.name!r}, R={self.indices}, T={self.tokens})"
