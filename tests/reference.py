"""Ground truth for the forward-kernel tests: deep attention (spec §2) in mpmath at 50 digits.

Written straight from spec/SMI.md §2, independently of derive/, codegen/ and smi_core/:

    Φ⁽⁰⁾ = I_T,   u_ℓ = Φ⁽ℓ⁻¹⁾ h_ℓᵀ,   Φ⁽ℓ⁾ = (c I_T + σ_β(u_ℓ u_ℓᵀ)) Φ⁽ℓ⁻¹⁾  (ℓ = 1 … L-1),
    y = σ_β(u_L u_Lᵀ),   σ_β(M) = row-wise softmax of β·M.

Also the other architectures of §2 (untied keys/queries, multi-head with readout weights,
sequence-to-sequence output Φ⁽ᴸ⁾) and last-layer links (softmax, hardmax, linear); Φ⁽ᴸ⁻¹⁾ and
log|det Φ⁽ᴸ⁻¹⁾|; and the Jacobian ∂y/∂Z by central finite differences (step 1e-50, evaluated at
150 digits, so the error is ≈ 1e-100 absolute: see FD_DPS).

Conventions that the spec leaves to the API (documented in derive/attention.py and followed here):
row blocks of H layer by layer; within an untied layer the r key rows k_ℓ come first, then the r
query rows q_ℓ, and the logits are M = (Φ q_ℓᵀ)(Φ k_ℓᵀ)ᵀ (row t = query token t); within a
multi-head layer head k owns rows k·r … (k+1)·r - 1 and A_ℓ = Σ_k a_ℓk σ_β(u_ℓk u_ℓkᵀ); hardmax is
the one-hot row argmax (first maximum on ties).

Inputs are float64 arrays, converted exactly to 50-digit numbers; results come back as float64
arrays (correctly rounded, so the conversion adds at most 1.1e-16 relative error), or as mpmath
numbers from the ``*_mp`` functions.  A private mpmath context is used, so the global
``mpmath.mp.dps`` is left alone.
"""
from __future__ import annotations

import mpmath
import numpy as np

mp = mpmath.MPContext()
mp.dps = 50

# Finite differences: step 1e-50 at 150 digits.  Truncation error O(step²) ≈ 1e-100 (times the
# third derivative), cancellation error ≈ 1e-150 / 1e-50 = 1e-100, both absolute.  (At 50 digits
# with step 1e-20 the cancellation error would be 1e-30 absolute, larger than the whole Jacobian
# of a saturated softmax.)
FD_DPS = 150
FD_STEP = mp.mpf("1e-50")


# -- small dense linear algebra on lists of mpf -------------------------------------------------

def to_mp(A) -> list:
    """A float64 array (any shape) as nested lists of exact mpf values."""
    A = np.asarray(A, dtype=np.float64)
    if A.ndim == 0:
        return mp.mpf(float(A))
    return [to_mp(a) for a in A]


def to_float(A) -> np.ndarray:
    """Nested lists of mpf as a float64 array (correctly rounded)."""
    if isinstance(A, list):
        return np.array([to_float(a) for a in A], dtype=np.float64)
    return np.float64(float(A))


def eye(T: int) -> list:
    return [[mp.one if i == j else mp.zero for j in range(T)] for i in range(T)]


def matmul(A: list, B: list) -> list:
    inner, cols = len(B), len(B[0])
    return [[mp.fsum(A[i][k] * B[k][j] for k in range(inner)) for j in range(cols)]
            for i in range(len(A))]


def transpose(A: list) -> list:
    return [list(col) for col in zip(*A)]


def add(A: list, B: list) -> list:
    return [[a + b for a, b in zip(ra, rb)] for ra, rb in zip(A, B)]


def scale(s, A: list) -> list:
    return [[s * a for a in row] for row in A]


def softmax_rows(M: list, beta) -> list:
    """σ_β(M): row t ↦ exp(β M_ts) / Σ_s' exp(β M_ts') (no overflow at 50 digits: mpmath
    exponents are unbounded)."""
    out = []
    for row in M:
        e = [mp.exp(beta * x) for x in row]
        total = mp.fsum(e)
        out.append([x / total for x in e])
    return out


def hardmax_rows(M: list, beta=None) -> list:
    """One-hot argmax of each row (first maximum on ties)."""
    out = []
    for row in M:
        k = max(range(len(row)), key=lambda s: (row[s], -s))
        out.append([mp.one if s == k else mp.zero for s in range(len(row))])
    return out


def linear_rows(M: list, beta=None) -> list:
    return [list(row) for row in M]


LINKS = {"softmax": softmax_rows, "hardmax": hardmax_rows, "linear": linear_rows}


# -- the model ---------------------------------------------------------------------------------

def rows_per_layer(architecture: str, rank: int, heads: int = 1) -> int:
    return {"untied": 2 * rank, "multihead": heads * rank}.get(architecture, rank)


def _logits(Phi: list, rows: list, rank: int, architecture: str) -> list:
    """M = u uᵀ with u = Φ hᵀ (tied), or (Φ qᵀ)(Φ kᵀ)ᵀ with rows = [k; q] (untied)."""
    if architecture == "untied":
        uk = matmul(Phi, transpose(rows[:rank]))
        uq = matmul(Phi, transpose(rows[rank:]))
        return matmul(uq, transpose(uk))
    u = matmul(Phi, transpose(rows))
    return matmul(u, transpose(u))


def _attention(Phi, Z, layer, spec, link) -> list:
    """A_ℓ (or the output y for the last layer): the link of this layer's logits, summed over
    heads with the readout weights when multi-head."""
    L, T, r, arch, heads, readout, beta = spec
    width = rows_per_layer(arch, r, heads)
    rows = Z[layer * width:(layer + 1) * width]
    f = LINKS[link]
    if arch == "multihead":
        total = [[mp.zero] * T for _ in range(T)]
        for k in range(heads):
            M = _logits(Phi, rows[k * r:(k + 1) * r], r, "tied")
            total = add(total, scale(readout[layer][k], f(M, beta)))
        return total
    return f(_logits(Phi, rows, r, arch), beta)


def _spec(Z, layers, rank, beta, architecture, heads, readout):
    T = len(Z[0])
    if architecture == "multihead":
        readout = ([[mp.one / heads] * heads for _ in range(layers)] if readout is None
                   else to_mp(readout))
    return (layers, T, rank, architecture, heads, readout, mp.mpf(beta))


def mixing_mp(Z: list, layers: int, rank: int = 1, skip=1.0, beta=1.0, architecture="tied",
              heads: int = 1, readout=None, upto: int | None = None) -> list:
    """Φ⁽ᵘᵖᵗᵒ⁾ (default Φ⁽ᴸ⁻¹⁾) from the index rows Z (mpf lists): the first ``upto`` layers'
    rows are used, any further rows are ignored."""
    upto = layers - 1 if upto is None else upto
    assert len(Z) >= upto * rows_per_layer(architecture, rank, heads)
    spec = _spec(Z, layers, rank, beta, architecture, heads, readout)
    T = spec[1]
    c = mp.mpf(skip)
    Phi = eye(T)
    for layer in range(upto):
        A = _attention(Phi, Z, layer, spec, "softmax")
        Phi = matmul(add(scale(c, eye(T)), A), Phi)
    return Phi


def forward_mp(Z: list, layers: int, rank: int = 1, skip=1.0, beta=1.0, architecture="tied",
               link="softmax", heads: int = 1, readout=None) -> list:
    """y = g(Z) (T×T mpf lists) for one sample Z (R×T mpf lists)."""
    assert len(Z) == layers * rows_per_layer(architecture, rank, heads), (len(Z), layers)
    spec = _spec(Z, layers, rank, beta, architecture, heads, readout)
    if architecture == "seq2seq":
        return mixing_mp(Z, layers, rank, skip, beta, "tied", upto=layers)
    Phi = mixing_mp(Z, layers, rank, skip, beta, architecture, heads, readout)
    return _attention(Phi, Z, layers - 1, spec, link)


def last_layer_vector_mp(Z: list, layers: int, skip=1.0, beta=1.0) -> list:
    """u_L = Φ⁽ᴸ⁻¹⁾ h_Lᵀ (tied, rank 1) as a list of T mpf."""
    Phi = mixing_mp(Z, layers, 1, skip, beta)
    return [row[0] for row in matmul(Phi, transpose(Z[layers - 1:layers]))]


def jacobian_mp(f, Z: list, step=FD_STEP, dps=FD_DPS) -> list:
    """∂f/∂Z by central differences: rows = entries of f(Z) flattened row-major, columns =
    Z[a][t] ↦ a·T + t.  The step is relative (step · max(1, |Z[a][t]|)), and f is evaluated
    at ``dps`` digits so that the cancellation error ≈ 10^-dps / step is an ABSOLUTE error far
    below the smallest derivatives of interest (a saturated softmax has entries and
    derivatives down to e^-100 ≈ 1e-44 next to entries ≈ 1)."""
    T = len(Z[0])
    cols = []
    with mp.workdps(dps):
        for a in range(len(Z)):
            for t in range(T):
                h = step * max(mp.one, abs(Z[a][t]))
                plus = [list(row) for row in Z]
                minus = [list(row) for row in Z]
                plus[a][t] += h
                minus[a][t] -= h
                fp, fm = _flat(f(plus)), _flat(f(minus))
                cols.append([(p - m) / (2 * h) for p, m in zip(fp, fm)])
    return transpose(cols)


def _flat(A):
    return [x for row in A for x in row] if isinstance(A[0], list) else list(A)


# -- float64 front end (batched) ---------------------------------------------------------------

def forward(Z, layers: int, **kw) -> np.ndarray:
    """y for a batch Z (n, R, T) float64 → (n, T, T) float64."""
    return np.stack([to_float(forward_mp(to_mp(z), layers, **kw)) for z in np.asarray(Z)])


def forward_jacobian(Z, layers: int, **kw) -> np.ndarray:
    """∂y/∂Z for a batch (n, R, T) → (n, T·T, R·T), finite differences at 50 digits."""
    f = lambda z: forward_mp(z, layers, **kw)
    return np.stack([to_float(jacobian_mp(f, to_mp(z))) for z in np.asarray(Z)])


def mixing(Z, layers: int, **kw) -> tuple[np.ndarray, np.ndarray]:
    """(Φ⁽ᴸ⁻¹⁾ (n, T, T), log|det Φ⁽ᴸ⁻¹⁾| (n,)) for a batch of full or earlier-layer index rows."""
    phis, logdets = [], []
    for z in np.asarray(Z):
        Phi = mixing_mp(to_mp(z), layers, **kw)
        phis.append(to_float(Phi))
        logdets.append(float(mp.log(abs(mp.det(mp.matrix(Phi))))))
    return np.stack(phis), np.array(logdets)


def last_layer_vector(Z, layers: int, skip=1.0, beta=1.0) -> np.ndarray:
    """u_L (n, T) for a batch of tied rank-1 index rows (n, L, T)."""
    return np.stack([to_float(last_layer_vector_mp(to_mp(z), layers, skip, beta)) for z in np.asarray(Z)])


# -- drawing inputs with a chosen softmax saturation ---------------------------------------------

def scale_layers(raw, layers: int, rank: int, skip: float, beta: float, sizes) -> np.ndarray:
    """Tied index rows (R, T) with each layer's largest |β·logit| set to ``sizes[ℓ]``.

    Layer ℓ's logits u_ℓ u_ℓᵀ (u_ℓ = Φ⁽ℓ⁻¹⁾ h_ℓᵀ) are quadratic in h_ℓ and Φ⁽ℓ⁻¹⁾ does not
    depend on h_ℓ, so scaling the raw block h_ℓ by √(size / max|β u_ℓ u_ℓᵀ|) hits the target
    exactly; this is done layer by layer in float64 (the result is just an input: the reference
    then evaluates the model at it exactly).  A raw block of zeros stays zero.
    """
    Z = np.array(raw, dtype=np.float64, copy=True)
    T = Z.shape[1]
    Phi = np.eye(T)
    for layer in range(layers):
        h = Z[layer * rank:(layer + 1) * rank]
        u = Phi @ h.T
        M = u @ u.T
        big = beta * np.abs(M).max()
        if big > 0:
            Z[layer * rank:(layer + 1) * rank] *= np.sqrt(sizes[layer] / big)
        u = Phi @ Z[layer * rank:(layer + 1) * rank].T
        M = beta * (u @ u.T)
        e = np.exp(M - M.max(axis=1, keepdims=True))
        Phi = (skip * np.eye(T) + e / e.sum(axis=1, keepdims=True)) @ Phi
    return Z


def logit_sizes(Z, layers: int, rank: int, skip: float, beta: float) -> list[float]:
    """max |β·logit| of each layer (50-digit evaluation), for reporting the drawn saturation."""
    Zm = to_mp(Z)
    sizes = []
    for layer in range(layers):
        Phi = mixing_mp(Zm, layers, rank, skip, beta, upto=layer)
        M = _logits(Phi, Zm[layer * rank:(layer + 1) * rank], rank, "tied")
        sizes.append(float(max(abs(mp.mpf(beta) * x) for row in M for x in row)))
    return sizes


def logits_mp(Z: list, layers: int, rank: int = 1, skip=1.0, beta=1.0) -> list:
    """β·M_ℓ = β u_ℓ u_ℓᵀ of every layer (tied), stacked: a list of L T×T mpf lists."""
    out = []
    for layer in range(layers):
        Phi = mixing_mp(Z, layers, rank, skip, beta, upto=layer)
        M = _logits(Phi, Z[layer * rank:(layer + 1) * rank], rank, "tied")
        out.append(scale(mp.mpf(beta), M))
    return out


def logit_gradient_scale(Z, layers: int, rank: int = 1, skip=1.0, beta=1.0) -> np.ndarray:
    """G (n,): max over layers, entries and inputs of |∂(β·M_ℓ)/∂Z| (finite differences at 50
    digits): the scale of the logit derivatives that the softmax Jacobians multiply."""
    f = lambda z: [x for M in logits_mp(z, layers, rank, skip, beta) for row in M for x in row]
    return np.array([float(max(abs(x) for row in jacobian_mp(f, to_mp(z)) for x in row))
                     for z in np.asarray(Z)])
