"""Ground truth for the forward-kernel tests: deep attention (spec §2) in mpmath at 50 digits.

Written straight from spec/SMI.md §2, independently of derive/, codegen/ and smi_core/:

    Φ⁽⁰⁾ = I_T,   u_ℓ = Φ⁽ℓ⁻¹⁾ h_ℓᵀ,   Φ⁽ℓ⁾ = (c I_T + σ_β(u_ℓ u_ℓᵀ)) Φ⁽ℓ⁻¹⁾  (ℓ = 1 … L-1),
    y = σ_β(u_L u_Lᵀ),   σ_β(M) = row-wise softmax of β·M.

Also the other architectures of §2 (untied keys/queries, multi-head with readout weights,
sequence-to-sequence output Φ⁽ᴸ⁾) and last-layer links (softmax, hardmax, linear); Φ⁽ᴸ⁻¹⁾,
log|det Φ⁽ᴸ⁻¹⁾| and the condition number of that determinant; and the Jacobian ∂y/∂Z by central
finite differences (relative step 1e-50 evaluated at 150 digits or more, so its error is
≈ 1e-100 absolute at unit scale: see FD_DPS and jacobian_mp).

Conventions that the spec leaves to the API (documented in derive/attention.py and followed here):
row blocks of H layer by layer; within an untied layer the r key rows k_ℓ come first, then the r
query rows q_ℓ, and the logits are M = (Φ q_ℓᵀ)(Φ k_ℓᵀ)ᵀ (row t = query token t); within a
multi-head layer head k owns rows k·r … (k+1)·r - 1 and A_ℓ = Σ_k a_ℓk σ_β(u_ℓk u_ℓkᵀ), and the
output is Σ_k a_Lk s(u_Lk u_Lkᵀ); hardmax is the one-hot row argmax (first maximum on ties).

Inputs are float64 arrays, converted exactly to 50-digit numbers; results come back as float64
arrays (correctly rounded, so the conversion adds at most 1.1e-16 relative error).  A private
mpmath context is used, so the global ``mpmath.mp.dps`` is left alone.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from itertools import permutations

import mpmath
import numpy as np

mp = mpmath.MPContext()
mp.dps = 50

# Finite differences: relative step 1e-50 at 150 digits (more for inputs below unit scale, see
# jacobian_mp).  Truncation error O(step²) ≈ 1e-100 (times the third derivative), cancellation
# error ≈ 1e-150 / 1e-50 = 1e-100, both absolute.  (At 50 digits with a step of 1e-20 the
# cancellation error would be 1e-30 absolute: larger than the whole Jacobian of a saturated
# softmax, whose entries go down to e^-100 ≈ 1e-44 next to entries ≈ 1.)
FD_DPS = 150
FD_STEP = "1e-50"


# -- small dense linear algebra on lists of mpf -------------------------------------------------

def to_mp(A):
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


def zeros(T: int) -> list:
    return [[mp.zero] * T for _ in range(T)]


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


def det(A: list):
    """Determinant by the Leibniz formula (T ≤ 4 here: at most 24 terms), exact up to the
    working precision; unlike mpmath's LU it never gives up on a (nearly) singular matrix."""
    n = len(A)
    total = []
    for perm in permutations(range(n)):
        sign = 1
        for i in range(n):
            for j in range(i + 1, n):
                if perm[i] > perm[j]:
                    sign = -sign
        term = mp.mpf(sign)
        for i in range(n):
            term *= A[i][perm[i]]
        total.append(term)
    return mp.fsum(total)


def cofactors(A: list) -> list:
    """cof_ij = (-1)^(i+j) det(A without row i and column j); A⁻¹ = cofᵀ / det A."""
    n = len(A)
    if n == 1:
        return [[mp.one]]
    return [[(-1) ** (i + j) * det([[A[k][l] for l in range(n) if l != j] for k in range(n) if k != i])
             for j in range(n)] for i in range(n)]


def permanent_abs(A: list):
    """Σ over permutations of Π |A_i,perm(i)|: the size of the terms that det A sums."""
    n = len(A)
    return mp.fsum(mp.fprod(abs(A[i][p[i]]) for i in range(n)) for p in permutations(range(n)))


# -- links ---------------------------------------------------------------------------------------

def softmax_rows(M: list, beta) -> list:
    """σ_β(M): row t ↦ exp(β M_ts) / Σ_s' exp(β M_ts').  No shift is needed: mpmath exponents
    are unbounded, so nothing overflows."""
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

@dataclass(frozen=True)
class Model:
    """A deep-attention model of spec §2: structure (layers, tokens, rank, architecture, link,
    heads) and runtime parameters (skip c, inverse temperature β, multi-head readout a_ℓk)."""

    layers: int
    tokens: int
    rank: int = 1
    skip: float = 1.0
    beta: float = 1.0
    architecture: str = "tied"
    link: str = "softmax"
    heads: int = 1
    readout: tuple | None = None      # layers × heads (multihead); default 1/heads
    perturb: tuple | None = None      # (δ, seed): every intermediate value × (1 ± δ), see below

    @property
    def width(self) -> int:
        """Index rows per layer."""
        return {"untied": 2 * self.rank, "multihead": self.heads * self.rank}.get(self.architecture, self.rank)

    @property
    def indices(self) -> int:
        return self.layers * self.width

    def _p(self, A: list, *tag) -> list:
        """A with every entry multiplied by a fixed factor 1 + δξ, ξ = ±1 drawn once per
        (seed, tag, entry), when the model is ``perturb``-ed; A itself otherwise.  The factors do
        not depend on Z, so the perturbed model is as smooth as the model."""
        if self.perturb is None:
            return A
        delta, seed = mp.mpf(self.perturb[0]), self.perturb[1]
        sign = lambda i, j: 1 - 2 * (hashlib.blake2b(f"{seed}:{tag}:{i}:{j}".encode()).digest()[0] & 1)
        return [[x * (1 + delta * sign(i, j)) for j, x in enumerate(row)] for i, row in enumerate(A)]

    def _readout(self, layer: int, head: int):
        if self.readout is None:
            return mp.mpf(1.0 / self.heads)      # the float the API passes
        return mp.mpf(float(self.readout[layer][head]))

    # the recursion, one sample, mpf lists ------------------------------------------------------

    def layer_logits(self, Phi: list, Z: list, layer: int) -> list:
        """The logit matrices M of each head of ``layer`` (one unless multi-head), given
        Φ⁽ˡᵃʸᵉʳ⁻¹⁾: u uᵀ with u = Φ hᵀ (tied), or (Φ qᵀ)(Φ kᵀ)ᵀ with the rows [k; q] (untied)."""
        r = self.rank
        rows = Z[layer * self.width:(layer + 1) * self.width]
        if self.architecture == "untied":
            uk = self._p(matmul(Phi, transpose(rows[:r])), "uk", layer)
            uq = self._p(matmul(Phi, transpose(rows[r:])), "uq", layer)
            return [self._p(matmul(uq, transpose(uk)), "M", layer)]
        heads = self.heads if self.architecture == "multihead" else 1
        out = []
        for k in range(heads):
            u = self._p(matmul(Phi, transpose(rows[k * r:(k + 1) * r])), "u", layer, k)
            out.append(self._p(matmul(u, transpose(u)), "M", layer, k))
        return out

    def attention(self, Phi: list, Z: list, layer: int, link: str = "softmax") -> list:
        """A_ℓ (or the output, for the last layer): the link of this layer's logits, combined
        over heads with the readout weights when multi-head."""
        f, beta = LINKS[link], mp.mpf(self.beta)
        mats = [self._p(f(M, beta), "A", layer, k) for k, M in enumerate(self.layer_logits(Phi, Z, layer))]
        if self.architecture != "multihead":
            return mats[0]
        total = zeros(self.tokens)
        for k, A in enumerate(mats):
            total = add(total, scale(self._readout(layer, k), A))
        return self._p(total, "sum", layer)

    def mixing_mp(self, Z: list, upto: int | None = None) -> list:
        """Φ⁽ᵘᵖᵗᵒ⁾ (default Φ⁽ᴸ⁻¹⁾) from the index rows Z: only the first ``upto`` layers' rows
        are read."""
        upto = self.layers - 1 if upto is None else upto
        assert len(Z) >= upto * self.width, (len(Z), upto, self.width)
        T, c = self.tokens, mp.mpf(self.skip)
        Phi = eye(T)
        for layer in range(upto):
            A = self.attention(Phi, Z, layer, "softmax")
            Phi = self._p(matmul(add(scale(c, eye(T)), A), Phi), "Phi", layer)
        return Phi

    def forward_mp(self, Z: list) -> list:
        """y = g(Z) (T×T) for one sample Z (R×T)."""
        assert len(Z) == self.indices and len(Z[0]) == self.tokens, (len(Z), self.indices)
        if self.architecture == "seq2seq":
            return self.mixing_mp(Z, upto=self.layers)
        Phi = self.mixing_mp(Z)
        return self.attention(Phi, Z, self.layers - 1, self.link)

    def logits_mp(self, Z: list) -> list:
        """β·M of every layer and head, flattened to one list."""
        beta, out = mp.mpf(self.beta), []
        for layer in range(self.layers):
            Phi = self.mixing_mp(Z, upto=layer)
            for M in self.layer_logits(Phi, Z, layer):
                out += [beta * x for row in M for x in row]
        return out

    def last_layer_vector_mp(self, Z: list) -> list:
        """u_L = Φ⁽ᴸ⁻¹⁾ h_Lᵀ (tied, rank 1)."""
        assert self.architecture == "tied" and self.rank == 1
        Phi = self.mixing_mp(Z)
        return [row[0] for row in matmul(Phi, transpose(Z[self.layers - 1:self.layers]))]

    # float64 front end, batched (n, ...) -------------------------------------------------------

    def forward(self, Z) -> np.ndarray:
        """y (n, T, T) for Z (n, R, T)."""
        return np.stack([to_float(self.forward_mp(to_mp(z))) for z in np.asarray(Z)])

    def forward_jacobian(self, Z) -> np.ndarray:
        """∂y/∂Z (n, T·T, R·T) by finite differences (rows y[t, s] ↦ t·T + s, columns
        Z[a, t] ↦ a·T + t)."""
        return np.stack([to_float(jacobian_mp(self.forward_mp, to_mp(z))) for z in np.asarray(Z)])

    def jacobian_sensitivity(self, Z, delta: float = 1e-13, draws: int = 2, seed: int = 0) -> np.ndarray:
        """S (n,): how far the exact Jacobian moves when the inputs and every intermediate value
        (logits, u_ℓ, attention matrices, Φ⁽ℓ⁾) are multiplied by fixed random factors 1 ± δ:
        max over ``draws`` such perturbations of max|J_perturbed - J|.

        Rounding in any float64 evaluation acts like such perturbations, so an error below S
        reflects the conditioning of the Jacobian at Z, not a defect of the algorithm: e.g. when
        u_L is nearly constant, y depends on Z only through small differences of large numbers;
        or when ∂y/∂h_L relies on the rows of the attention matrices summing exactly to one."""
        rng = np.random.default_rng(seed)
        out = []
        for z in np.asarray(Z, dtype=np.float64):
            J = jacobian_mp(self.forward_mp, to_mp(z))
            worst = mp.zero
            for k in range(draws):
                xi = rng.choice([-1.0, 1.0], size=z.shape)
                zp = [[x * (1 + mp.mpf(delta) * mp.mpf(e)) for x, e in zip(row, erow)]
                      for row, erow in zip(to_mp(z), xi)]
                Jp = jacobian_mp(replace(self, perturb=(delta, seed + k)).forward_mp, zp)
                worst = max(worst, max(abs(a - b) for ra, rb in zip(J, Jp) for a, b in zip(ra, rb)))
            out.append(float(worst))
        return np.array(out)

    def mixing(self, Z) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """For a batch of full or earlier-layer index rows: Φ⁽ᴸ⁻¹⁾ (n, T, T), log|det Φ⁽ᴸ⁻¹⁾|
        (n,) (-inf when Φ is singular to 50 digits), and two ratios (n,), both ≥ 1 (inf when
        singular):

            κ   = Σ_ij |Φ_ij · cof_ij(Φ)| / |det Φ|, the condition number of the determinant:
                  log|det| computed from a Φ whose entries carry relative errors δ is
                  uncertain by ≈ κ·δ, whatever the algorithm;
            κ_H = Π_i ‖Φ_i,:‖₂ / |det Φ| (Hadamard ratio), the normwise counterpart: an
                  algorithm that is only normwise stable is accurate to ≈ u·κ_H.  κ_H ≫ κ
                  when the columns of Φ have very different scales."""
        phis, logdets, kappas, hadamard = [], [], [], []
        for z in np.asarray(Z):
            Phi = self.mixing_mp(to_mp(z))
            phis.append(to_float(Phi))
            d, T = det(Phi), len(Phi)
            if abs(d) <= mp.mpf(10) ** (20 - mp.dps) * permanent_abs(Phi):
                logdets.append(-np.inf)          # singular to within the 50-digit rounding
                kappas.append(np.inf)
                hadamard.append(np.inf)
                continue
            cof = cofactors(Phi)
            kappa = mp.fsum(abs(Phi[i][j] * cof[i][j]) for i in range(T) for j in range(T)) / abs(d)
            rows = mp.fprod(mp.sqrt(mp.fsum(x ** 2 for x in row)) for row in Phi)
            logdets.append(float(mp.log(abs(d))))
            kappas.append(float(kappa))
            hadamard.append(float(rows / abs(d)))
        return np.stack(phis), np.array(logdets), np.array(kappas), np.array(hadamard)

    def last_layer_vector(self, Z) -> np.ndarray:
        """u_L (n, T) for a batch (n, L, T) of tied rank-1 index rows."""
        return np.stack([to_float(self.last_layer_vector_mp(to_mp(z))) for z in np.asarray(Z)])

    def reparam_sensitivity(self, Z) -> tuple[np.ndarray, np.ndarray]:
        """(A_u, A_h), each (n,): first-order bounds on how far u_L and h_L move per unit
        relative perturbation of the entries of y and of Φ⁽ᴸ⁻¹⁾ (tied, rank 1):

            |δu| ≤ δ·K,  K = |J⁺| |y|,  J = ∂y/∂u at u_L, J⁺ = (JᵀJ)⁻¹Jᵀ
            |δh| ≤ δ·(|Φ⁻¹| K + |Φ⁻¹| |Φ| |h_L|)

        A_u = max K, A_h = max of the second bound (δ = 1).  Computed at 50 digits (J⁺ by QR), so
        a nearly singular J (u_L nearly constant: y nearly uniform, u_L barely identifiable) or Φ
        shows up as a huge A instead of being truncated; inf when J or Φ is singular to within
        1e-30 (e.g. h_L constant across tokens: then u_L is constant, since Φ 1 = (1+c)^(L-1) 1,
        and y is uniform)."""
        T = self.tokens
        last = Model(1, T, 1, beta=self.beta)
        A_u, A_h = [], []
        for z in np.asarray(Z, dtype=np.float64):
            zm = to_mp(z)
            u = self.last_layer_vector_mp(zm)
            y = [x for row in last.forward_mp([u]) for x in row]
            J = mp.matrix(jacobian_mp(last.forward_mp, [u]))
            Phi = self.mixing_mp(zm)
            Q, R = mp.qr(J, mode="skinny")            # J⁺ = R⁻¹ Qᵀ
            diag = [abs(R[i, i]) for i in range(T)]
            tiny = mp.mpf(10) ** (20 - mp.dps)
            d = det(Phi)
            if min(diag) <= tiny * max(diag) or abs(d) <= tiny * permanent_abs(Phi):
                A_u.append(np.inf)                    # singular to within 50-digit rounding
                A_h.append(np.inf)
                continue
            P = mp.inverse(R) * Q.T
            cof = cofactors(Phi)
            Pinv = mp.matrix([[cof[j][i] / d for j in range(T)] for i in range(T)])
            Phi = mp.matrix(Phi)
            K = [mp.fsum(abs(P[i, k]) * abs(y[k]) for k in range(T * T)) for i in range(T)]
            h = zm[self.layers - 1]
            PhiH = [mp.fsum(abs(Phi[i, j]) * abs(h[j]) for j in range(T)) for i in range(T)]
            bound = [mp.fsum(abs(Pinv[i, j]) * (K[j] + PhiH[j]) for j in range(T)) for i in range(T)]
            A_u.append(float(max(K)))
            A_h.append(float(max(bound)))
        return np.array(A_u), np.array(A_h)

    def scale_layers(self, raw, sizes) -> np.ndarray:
        """Index rows (R, T) with each layer's largest |β·logit| set to ``sizes[ℓ]``.

        Layer ℓ's logits are quadratic in its own rows and Φ⁽ℓ⁻¹⁾ does not depend on them, so
        scaling the raw block of layer ℓ by √(size / max|β·M_ℓ|) hits the target exactly (up to
        float64 rounding); this is done layer by layer.  The result is just an input: the
        reference then evaluates the model at it exactly.  A block of zeros stays zero."""
        Z = np.array(raw, dtype=np.float64, copy=True)
        beta = mp.mpf(self.beta)
        for layer in range(self.layers):
            Zm = to_mp(Z)
            Phi = self.mixing_mp(Zm, upto=layer)
            big = max(abs(beta * x) for M in self.layer_logits(Phi, Zm, layer) for row in M for x in row)
            if big > 0:
                Z[layer * self.width:(layer + 1) * self.width] *= float(mp.sqrt(mp.mpf(float(sizes[layer])) / big))
        return Z


def jacobian_mp(f, Z: list, step=FD_STEP, dps=FD_DPS) -> list:
    """∂f/∂Z by central differences: rows = entries of f(Z) flattened row-major, columns =
    Z[a][t] ↦ a·T + t.

    Each input gets a relative step, step · |Z[a][t]| (step · 1e-3 · max|Z| for a zero entry),
    and f is evaluated at ``dps`` digits plus 2 digits per decade that the smallest of these
    scales lies below 1, so that the cancellation error ≈ 10^-digits / step stays far below the
    smallest derivatives of interest: a saturated softmax has derivatives down to ≈ 1e-44 next
    to entries ≈ 1, and an input of scale s ≪ 1 gives derivatives of order β·s."""
    T = len(Z[0])
    s = max(abs(x) for row in Z for x in row)
    scales = [[abs(x) if x != 0 else (s / 1000 if s > 0 else mp.one) for x in row] for row in Z]
    smallest = min(x for row in scales for x in row)
    extra = 0 if smallest >= 1 else 2 * int(mp.ceil(-mp.log10(smallest)))
    cols = []
    with mp.workdps(dps + extra):
        step = mp.mpf(step)
        for a in range(len(Z)):
            for t in range(T):
                h = step * scales[a][t]
                plus = [list(row) for row in Z]
                minus = [list(row) for row in Z]
                plus[a][t] += h
                minus[a][t] -= h
                fp, fm = _flat(f(plus)), _flat(f(minus))
                cols.append([(p - m) / (2 * h) for p, m in zip(fp, fm)])
    return transpose(cols)


def _flat(A) -> list:
    return [x for row in A for x in row] if isinstance(A[0], list) else list(A)
