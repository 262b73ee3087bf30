"""Statistical properties of the stochastic codecs and of the shared RNG.

Every test uses fixed keys, so it is deterministic; the tolerances are set
from the codec's own variance so that a correct codec fails with a
probability far below 1e-6 for a random key (the margins are noted)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp as jc
from jaxcomp.ops.rng import rng_bits, rng_uniform

K = 4000  # keys (independent encodings) per test


@functools.partial(jax.jit, static_argnames=("codec",))
def _samples(x, keys, codec):
    return jax.vmap(lambda k: codec.decode(codec.encode(x, k, backend="xla")))(keys)


def _qsgd_levels(x, codec):
    """Per-element step and fractional grid position, as the codec sees them."""
    b = codec.bucket_size
    xb = np.pad(x, (0, -x.size % b)).reshape(-1, b).astype(np.float64)
    scale = np.sqrt((xb * xb).sum(1)) if codec.norm == "l2" else np.abs(xb).max(1)
    s = codec.levels
    r = np.abs(xb) / scale[:, None] * s
    step = np.repeat(scale / s, b)[: x.size]
    frac = (r - np.floor(r)).reshape(-1)[: x.size]
    return step, frac, xb, scale


@pytest.mark.parametrize(
    "codec",
    [
        jc.codecs.QSGD(bits=2, bucket_size=128),
        jc.codecs.QSGD(bits=4, bucket_size=512),
        jc.codecs.QSGD(bits=4, bucket_size=64, norm="l2"),
        jc.codecs.QSGD(bits=8, bucket_size=512),
    ],
    ids=repr,
)
def test_qsgd_is_unbiased_within_its_variance(codec):
    n = 2048
    rng = np.random.default_rng(codec.bits)
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)
    keys = jax.random.split(jax.random.key(1234), K)
    q = np.asarray(_samples(jnp.asarray(x), keys, codec), np.float64)
    step, frac, _xb, _scale = _qsgd_levels(x, codec)
    var = step**2 * frac * (1 - frac)  # exact per-element variance of the codec
    mean = q.mean(0)

    # Each sample is one of the two neighbouring levels.
    lo = np.floor(np.abs(x) / step + 1e-6)
    assert np.all(np.abs(np.abs(q) / step - lo) < 1 + 1e-4)

    # Unbiased: z-scores of the mean over K keys. Elements whose Bernoulli is
    # too lopsided for the normal approximation (K p (1-p) < 20) are checked
    # by an absolute bound instead.
    ok = K * frac * (1 - frac) >= 20
    z = (mean[ok] - x[ok]) / np.sqrt(var[ok] / K)
    m = ok.sum()
    assert m > n / 4
    assert abs(z.mean()) < 6 / np.sqrt(m)  # 6 sigma of the mean of m z-scores
    chi2 = float((z**2).sum())
    assert abs(chi2 - m) < 6 * np.sqrt(2 * m), (chi2, m)  # chi^2(m), 6 sigma
    assert np.max(np.abs(z)) < 6.5
    rare = ~ok
    assert np.all(np.abs(mean[rare] - x[rare]) <= step[rare] * 60 / K + 1e-7)

    # Variance: matches p(1-p) step^2 and never exceeds the bound step^2 / 4.
    emp = q.var(0)
    assert np.all(emp <= step**2 / 4 * 1.2 + 1e-12)
    assert abs(emp.sum() / var.sum() - 1) < 0.05


def test_qsgd_l2_variance_bound_of_the_paper():
    """E||Q(v) - v||^2 <= min(n/s^2, sqrt(n)/s) ||v||^2 per bucket (QSGD, Lemma 3.1)."""
    codec = jc.codecs.QSGD(bits=2, bucket_size=256, norm="l2")
    n = 1024
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    keys = jax.random.split(jax.random.key(7), 1000)
    q = np.asarray(_samples(jnp.asarray(x), keys, codec), np.float64)
    b, s = codec.bucket_size, codec.levels
    err = ((q - x) ** 2).reshape(len(keys), -1, b).sum(-1).mean(0)
    norm2 = (x.astype(np.float64).reshape(-1, b) ** 2).sum(-1)
    bound = min(b / s**2, np.sqrt(b) / s) * norm2
    assert np.all(err <= bound)


def test_keys_give_independent_encodings():
    codec = jc.codecs.QSGD(bits=2, bucket_size=512)
    # Every value but each bucket's max (1.0) rounds to 0 or 1 with p = 1/2.
    x = jnp.full((4096,), 0.5, jnp.float32).at[::512].set(1.0)
    keys = jax.random.split(jax.random.key(3), 64)
    coins = (
        np.asarray(_samples(x, keys, codec)).reshape(64, -1, 512)[:, :, 1:].reshape(64, -1) > 0.75
    )
    m = coins.shape[1]
    assert abs(coins.mean() - 0.5) < 6 * 0.5 / np.sqrt(coins.size)
    # Pairwise agreement between keys: 0.5 +- 6 sigma for m fair coins.
    agree = (coins[:, None, :] == coins[None, :, :]).mean(-1)[np.triu_indices(64, 1)]
    assert np.all(np.abs(agree - 0.5) < 6 * 0.5 / np.sqrt(m))


def test_rng_is_uniform_and_decorrelated():
    seed = jnp.asarray([0x12345678, 0x9ABCDEF0], jnp.uint32)
    idx = jnp.arange(1 << 20, dtype=jnp.uint32)
    u = np.asarray(rng_uniform(seed, idx), np.float64)
    counts = np.histogram(u, bins=64, range=(0, 1))[0]
    expected = u.size / 64
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 63 + 6 * np.sqrt(2 * 63)
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 6 / np.sqrt(u.size)
    # Each output bit is a fair coin.
    bits = np.asarray(rng_bits(seed, idx))
    ones = np.array([((bits >> i) & 1).mean() for i in range(32)])
    assert np.all(np.abs(ones - 0.5) < 6 * 0.5 / np.sqrt(bits.size))
    # Neighbouring seeds give unrelated streams, not shifted copies.
    seed2 = seed.at[0].add(1)
    u2 = np.asarray(rng_uniform(seed2, idx), np.float64)
    assert abs(np.corrcoef(u, u2)[0, 1]) < 6 / np.sqrt(u.size)
    assert abs(np.corrcoef(u[1:], u2[:-1])[0, 1]) < 6 / np.sqrt(u.size)


def _z_checks(q, x, var, step_abs):
    """Unbiasedness by z-scores over K keys (as for QSGD above); elements whose
    Bernoulli is too lopsided for the normal approximation are checked by an
    absolute bound."""
    mean = q.mean(0)
    ok = K * var / np.maximum(step_abs, 1e-30) ** 2 >= 20
    z = (mean[ok] - x[ok]) / np.sqrt(var[ok] / K)
    m = ok.sum()
    assert m > x.size / 4
    assert abs(z.mean()) < 6 / np.sqrt(m)
    chi2 = float((z**2).sum())
    assert abs(chi2 - m) < 6 * np.sqrt(2 * m), (chi2, m)
    assert np.max(np.abs(z)) < 6.5
    rare = ~ok
    assert np.all(np.abs(mean[rare] - x[rare]) <= step_abs[rare] * 60 / K + 1e-7)


@pytest.mark.parametrize("bucket", [64, 512])
def test_terngrad_is_unbiased_with_its_variance(bucket):
    """TernGrad (Wen et al. 2017): E[t * s] = v and Var = s^2 p (1 - p),
    p = |v| / s, s = the bucket's max|v|."""
    codec = jc.codecs.TernGrad(bucket_size=bucket)
    n = 2048
    rng = np.random.default_rng(bucket)
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)
    keys = jax.random.split(jax.random.key(99), K)
    q = np.asarray(_samples(jnp.asarray(x), keys, codec), np.float64)
    s = np.repeat(np.abs(x.astype(np.float64)).reshape(-1, bucket).max(1), bucket)
    # Every sample is 0 or sign(v) * s.
    assert np.all((q == 0) | (q == np.sign(x) * s.astype(np.float32)))
    p = np.abs(x) / s
    var = s**2 * p * (1 - p)
    _z_checks(q, x.astype(np.float64), var, s)
    emp = q.var(0)
    assert np.all(emp <= s**2 / 4 * 1.2 + 1e-12)
    assert abs(emp.sum() / var.sum() - 1) < 0.05


def _natural_inputs(n, seed):
    """Values over ~40 binades (within the codec's 63 below each bucket's top)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp2(rng.uniform(-20, 20, n))).astype(np.float32)


def test_natural_outputs_are_signed_powers_of_two():
    x = _natural_inputs(4096, 1)
    x[:4] = [0.0, -0.0, 3e-39, -3e-39]
    for codec in (jc.codecs.Natural(), jc.codecs.Natural(stochastic=False)):
        for s in range(4):
            y = np.asarray(codec.decode(codec.encode(jnp.asarray(x), jax.random.key(s))))
            assert np.all(y[:4] == 0)
            mant, _ = np.frexp(np.abs(y[4:]))
            assert np.all(mant == 0.5)  # exactly 2^k
            assert np.all(np.sign(y[4:]) == np.sign(x[4:]))
            # And one of the two powers around |x| (or |x| itself).
            ratio = np.abs(y[4:]).astype(np.float64) / np.abs(x[4:])
            assert np.all((ratio > 0.5) & (ratio <= 2))


def test_natural_is_unbiased_with_variance_at_most_an_eighth():
    """C_nat (the IntML paper; Theorem 1 of its technical report): unbiased,
    E[(C(t) - t)^2] = 4^a p (1 - p) <= t^2 / 8 for |t| in [2^a, 2^(a+1)),
    p = |t| / 2^a - 1 (the maximum, 1/8, at |t| = 4/3 * 2^a)."""
    codec = jc.codecs.Natural(bucket_size=512)
    n = 2048
    x = _natural_inputs(n, 2)
    x[:8] = np.float32(4 / 3) * np.exp2(np.arange(8) - 4).astype(np.float32)  # the worst case
    keys = jax.random.split(jax.random.key(77), K)
    q = np.asarray(_samples(jnp.asarray(x), keys, codec), np.float64)
    t = np.abs(x.astype(np.float64))
    lo = np.exp2(np.floor(np.log2(t)))
    p = t / lo - 1
    var = lo**2 * p * (1 - p)
    assert np.all(var <= t**2 / 8 * (1 + 1e-12))
    _z_checks(q, x.astype(np.float64), var, lo)
    emp = ((q - x.astype(np.float64)) ** 2).mean(0)
    assert np.all(emp <= t**2 / 8 * 1.2)
    assert abs(emp.sum() / var.sum() - 1) < 0.05


def test_natural_underflow_rounding_is_unbiased():
    """Values more than 63 binades below the bucket's top round to 0 or the
    smallest power 2^(top - 63) with probability |v| / 2^(top - 63)."""
    codec = jc.codecs.Natural(bucket_size=8)
    small = np.float32(2.0**-70) * np.float32(1.2345)
    x = np.array([1.0, small, -small, small * 3, 0, 0, 0, 0], np.float32)
    keys = jax.random.split(jax.random.key(5), K)
    q = np.asarray(_samples(jnp.asarray(x), keys, codec), np.float64)
    p_min = 2.0**-62  # top = biased exponent of 1.0, + 1; smallest = top - 63
    for i in (1, 2, 3):
        assert set(np.unique(q[:, i])) <= {0.0, np.sign(x[i]) * p_min}
        p = abs(float(x[i])) / p_min
        assert abs(np.mean(q[:, i] != 0) - p) < 6 * np.sqrt(p * (1 - p) / K)
