"""Bad input gives a ValueError that names the argument and the constraint (DESIGN.md, Errors):
shapes that disagree with the model, non-finite indices, outputs outside the softmax range,
outputs with no consistent pre-image, a singular mixing matrix, bad constructor arguments."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import model
from smi_core import DeepAttention


@pytest.fixture(scope="module")
def m():
    """L = 2, T = 3, r = 1: Z is (n, 2, 3), y is (n, 3, 3), h_prev is (n, 1, 3)."""
    return model(layers=2, tokens=3, rank=1, skip=0.5, beta=1.5)


@pytest.fixture(scope="module")
def Z():
    return np.random.default_rng(0).normal(size=(2, 2, 3))


# -- forward / forward_jacobian --------------------------------------------------------------------

BAD_SHAPES = [(2, 1, 3), (2, 3, 3), (2, 2, 4), (6,), (2, 6), (1, 2, 2, 3), (0, 3)]


@pytest.mark.parametrize("method", ["forward", "forward_jacobian"])
@pytest.mark.parametrize("shape", BAD_SHAPES, ids=str)
def test_wrong_shape(m, method, shape):
    with pytest.raises(ValueError, match=r"Z must have shape \(n, 2, 3\) or \(2, 3\), got " + re_shape(shape)):
        getattr(m, method)(np.zeros(shape))


def re_shape(shape):
    return r"\(" + ", ".join(map(str, shape)) + (r",\)" if len(shape) == 1 else r"\)")


@pytest.mark.parametrize("method", ["forward", "forward_jacobian"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_indices(m, Z, method, bad):
    Zb = Z.copy()
    Zb[1, 0, 2] = bad
    with pytest.raises(ValueError, match=r"Z must be finite \(sample 1 is not\)"):
        getattr(m, method)(Zb)


def test_single_sample_shape_is_accepted(m, Z):
    """The (R, T) form of one sample is valid input, not an error."""
    assert m.forward(Z[0]).shape == (3, 3)
    assert m.forward_jacobian(Z[0]).shape == (9, 6)


def test_missing_kernels(Z):
    with pytest.raises(ValueError, match="no 'jacobian' kernel"):
        model(layers=2, tokens=3, rank=1, link="hardmax").forward_jacobian(Z)
    with pytest.raises(ValueError, match="no 'mixing' kernel"):
        model(layers=1, tokens=3, rank=1).mixing(Z[:, :0])
    with pytest.raises(ValueError, match="no 'reparam' kernel"):
        model(layers=2, tokens=2, rank=2).reparametrise(np.full((2, 2), 0.5), np.zeros((2, 2, 2)))
    with pytest.raises(ValueError, match="no 'reparam' kernel"):
        model(layers=2, tokens=2, rank=1, link="linear").reparametrise(np.full((2, 2), 0.5), np.zeros((1, 2)))


def test_mixing_wrong_shape(m):
    with pytest.raises(ValueError, match=r"H must have shape \(n, 1, 3\)"):
        m.mixing(np.zeros((2, 3, 3)))


# -- reparametrise: shapes ---------------------------------------------------------------------

def test_reparam_shapes(m, Z):
    y = m.forward(Z)
    with pytest.raises(ValueError, match=r"y must have shape \(n, 3, 3\)"):
        m.reparametrise(y[:, :2], Z[:, :1])
    with pytest.raises(ValueError, match=r"h_prev must have shape \(n, 1, 3\)"):
        m.reparametrise(y, Z)
    with pytest.raises(ValueError, match=r"h_prev .* is required for layers=2"):
        m.reparametrise(y)
    with pytest.raises(ValueError, match="same number of samples, got 2 and 1"):
        m.reparametrise(y, Z[:1, :1])
    h = Z[:, :1].copy()
    h[0, 0, 1] = np.nan
    with pytest.raises(ValueError, match=r"h_prev must be finite \(sample 0 is not\)"):
        m.reparametrise(y, h)


# -- reparametrise: y outside the softmax range ------------------------------------------------

@pytest.fixture(scope="module")
def y(m, Z):
    return m.forward(Z)


def test_rows_not_summing_to_one(m, Z, y):
    bad = y.copy()
    bad[1, 2, 0] += 1e-3
    with pytest.raises(ValueError, match=r"y rows must sum to 1 \(softmax range\); sample 1 is off by 0.001"):
        m.reparametrise(bad, Z[:, :1])


@pytest.mark.parametrize("row", [[1.2, -0.1, -0.1], [1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [-0.2, 0.6, 0.6]], ids=str)
def test_entries_outside_unit_interval(m, Z, y, row):
    """Rows that sum to 1 but have an entry ≤ 0 or > 1: no softmax gives them."""
    bad = y.copy()
    bad[1, 1] = row
    with pytest.raises(ValueError, match=r"y must have entries inside \(0, 1\) \(softmax range\); sample 1"):
        m.reparametrise(bad, Z[:, :1])


def test_non_finite_output(m, Z, y):
    bad = y.copy()
    bad[0, 2, 2] = np.nan
    with pytest.raises(ValueError, match=r"y must be finite \(sample 0 is not\)"):
        m.reparametrise(bad, Z[:, :1])


@pytest.mark.parametrize("seed", range(5))
def test_inconsistent_output_T3(m, Z, seed):
    """A row-stochastic y with entries in (0, 1) whose log-ratios are not β u_t (u_s - u_t) for
    any u: 6 log-ratios, 3 unknowns (a random Dirichlet y, the second sample)."""
    y = m.forward(Z)
    y[1] = np.random.default_rng(seed).dirichlet(np.ones(3), size=3)
    with pytest.raises(ValueError, match=r"y has no consistent pre-image σ_β\(u uᵀ\) \(sample 1\)"):
        m.reparametrise(y, Z[:, :1])


def test_slightly_inconsistent_output_T4():
    """A model output whose log-ratios are perturbed by 1e-4 (then renormalised): rejected too."""
    m4 = model(layers=1, tokens=4, rank=1, beta=2.0)
    y = m4.forward(np.random.default_rng(1).normal(size=(1, 1, 4)))
    m4.reparametrise(y)                                      # the model's own output: fine
    bad = y * np.exp(1e-4 * np.random.default_rng(2).normal(size=y.shape))
    bad /= bad.sum(axis=2, keepdims=True)
    with pytest.raises(ValueError, match="no consistent pre-image"):
        m4.reparametrise(bad)


def test_inconsistent_output_T2():
    """T = 2 needs a + b = (u₁ - u₂)² > 0: y = [[0.3, 0.7], [0.7, 0.3]] has a + b < 0."""
    m2 = model(layers=1, tokens=2, rank=1)
    with pytest.raises(ValueError, match=r"no consistent pre-image .* \(sample 0\)"):
        m2.reparametrise(np.array([[0.3, 0.7], [0.7, 0.3]]))


def test_singular_mixing_matrix():
    """c = 0 and h₁ = 0 give Φ⁽¹⁾ = 11ᵀ/2, singular: h_L = Φ⁻¹u_L does not exist.  The error
    names h_prev (not y, which is a valid softmax output) and the sample."""
    y = model(layers=1, tokens=2, rank=1).forward(np.array([[[0.5, -1.0]], [[0.2, 0.9]]]))
    h_prev = np.array([[[0.3, -0.4]], [[0.0, 0.0]]])
    with pytest.raises(ValueError, match=r"h_prev gives a singular mixing matrix Φ⁽ᴸ⁻¹⁾ \(sample 1\)"):
        model(layers=2, tokens=2, rank=1, skip=0.0).reparametrise(y, h_prev)


# -- constructor ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(layers=0), r"layers must be a positive integer, got 0"),
    (dict(layers=-1), r"layers must be a positive integer, got -1"),
    (dict(layers=2.0), r"layers must be a positive integer, got 2.0"),
    (dict(tokens=0), r"tokens must be a positive integer, got 0"),
    (dict(rank=0), r"rank must be a positive integer, got 0"),
    (dict(beta=0.0), r"beta must be > 0 and finite, got 0.0"),
    (dict(beta=-1.0), r"beta must be > 0 and finite, got -1.0"),
    (dict(beta=np.inf), r"beta must be > 0 and finite, got inf"),
    (dict(beta=np.nan), r"beta must be > 0 and finite, got nan"),
    (dict(skip=-0.1), r"skip must be ≥ 0 and finite, got -0.1"),
    (dict(skip=np.nan), r"skip must be ≥ 0 and finite, got nan"),
    (dict(architecture="transformer"), r"architecture must be one of \('tied', 'untied', 'multihead', 'seq2seq'\), got 'transformer'"),
    (dict(link="relu"), r"link must be one of \('softmax', 'hardmax', 'linear'\), got 'relu'"),
    (dict(heads=2), r"heads > 1 needs architecture='multihead'"),
    (dict(architecture="multihead", heads=2, readout=np.ones((3, 2))), r"readout must be a finite \(2, 2\) array"),
    (dict(architecture="multihead", heads=2, readout=np.array([[1.0, np.nan], [1.0, 1.0]])), r"readout must be a finite"),
    (dict(readout=np.ones((2, 1))), r"readout is only used with architecture='multihead'"),
    (dict(architecture="seq2seq", link="hardmax"), r"link must be 'softmax' for architecture='seq2seq'"),
], ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_bad_constructor_arguments(kwargs, message):
    args = dict(layers=2, tokens=2, rank=1) | kwargs
    with pytest.raises(ValueError, match=message):
        DeepAttention(**args)


def test_bad_backend():
    """An unknown backend is reported (on first use: kernels are loaded lazily)."""
    with pytest.raises(ValueError, match=r"backend must be one of \('compiled', 'twin'\), got 'gpu'"):
        DeepAttention(layers=2, tokens=2, rank=1, backend="gpu").forward(np.zeros((2, 2)))


@pytest.mark.parametrize("key", ["logit", "cusp", "gauss"])
def test_escalation_switches_must_be_bool(key):
    with pytest.raises(ValueError, match=rf"escalation\['{key}'\] must be True or False, got 1"):
        DeepAttention(2, 2).channel(escalation={key: 1})
    with pytest.raises(ValueError, match=r"escalation takes \[.*'cusp'.*\], got 'cusps'"):
        DeepAttention(2, 2).channel(escalation={"cusps": False})
