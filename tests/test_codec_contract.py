"""The contract every codec passes: shapes, dtypes, jit, vmap, bit-exact
backends, payload accounting, special values and clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONTRACT_CODECS, FLOAT_DTYPES, codec_id
from helpers import assert_same_bytes, assert_same_payload, decode, encode, gradient_like

import jaxcomp as jc

KEY = jax.random.key(42)
SHAPES = [(), (0,), (1,), (7,), (3, 5, 7), (1029,), (2, 1000)]
ODD_SIZES = [1, 5, 8, 63, 65, 513, 1029, 4099, 70001]

codecs = pytest.mark.parametrize("codec", CONTRACT_CODECS, ids=codec_id)
dtypes = pytest.mark.parametrize("dtype", FLOAT_DTYPES)
needs_ffi = pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")


@codecs
@dtypes
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_roundtrip_shape_and_dtype(codec, dtype, shape):
    x = gradient_like(int(np.prod(shape)), seed=1, dtype=dtype).reshape(shape)
    p = encode(x, KEY, codec)
    assert p.shape == shape and p.dtype == np.dtype(dtype)
    y = decode(p)
    assert y.shape == shape and y.dtype == x.dtype
    assert p.nbytes == codec.wire_nbytes(shape, dtype)
    if type(codec).used_nbytes is jc.codecs.Codec.used_nbytes:
        assert int(p.used_nbytes) == p.nbytes
    else:  # variable rate (ThreeLC): part of a fixed-capacity buffer
        assert 0 < int(p.used_nbytes) <= p.nbytes
    for name, spec in codec.layout(shape, dtype).items():
        assert p[name].shape == spec.shape and p[name].dtype == spec.dtype, name


@needs_ffi
@codecs
@dtypes
@pytest.mark.parametrize("n", ODD_SIZES)
def test_backends_bit_identical(codec, dtype, n):
    x = gradient_like(n, seed=n, dtype=dtype)
    key = jax.random.fold_in(KEY, n)
    p_ffi = encode(x, key, codec, "ffi")
    p_xla = encode(x, key, codec, "xla")
    assert_same_payload(p_ffi, p_xla, f"{codec!r} {dtype} n={n} encode")
    assert_same_bytes(decode(p_ffi, "ffi"), decode(p_ffi, "xla"), "decode")


@needs_ffi
@codecs
def test_backends_bit_identical_under_jit(codec):
    x = gradient_like(3001, seed=7)
    enc = {b: jax.jit(lambda x, k, b=b: codec.encode(x, k, backend=b)) for b in ("ffi", "xla")}
    dec = {b: jax.jit(lambda p, b=b: codec.decode(p, backend=b)) for b in ("ffi", "xla")}
    p = enc["ffi"](x, KEY)
    assert_same_payload(p, enc["xla"](x, KEY), "jit encode")
    assert_same_payload(p, codec.encode(x, KEY), "jit vs eager")
    assert_same_bytes(dec["ffi"](p), dec["xla"](p), "jit decode")


@codecs
def test_vmap_matches_per_example(codec):
    xs = jnp.stack([gradient_like(300, seed=s) for s in range(3)])
    keys = jax.random.split(KEY, 3)
    batched = jax.vmap(lambda x, k: codec.decode(codec.encode(x, k)))(xs, keys)
    for i in range(3):
        assert_same_bytes(batched[i], codec.decode(codec.encode(xs[i], keys[i])), f"example {i}")


@codecs
def test_payload_is_a_pytree_and_codec_is_static(codec):
    x = gradient_like(100, seed=3)
    p = codec.encode(x, KEY)
    leaves, treedef = jax.tree_util.tree_flatten(p)
    assert len(leaves) == len(p.arrays)
    q = jax.tree_util.tree_unflatten(treedef, leaves)
    assert_same_payload(p, q)
    assert hash(codec) == hash(jc.codecs.get(codec.name, **_params(codec)))
    assert jc.codecs.get(codec.name, **_params(codec)) == codec
    # Usable as a static argument.
    f = jax.jit(lambda x, k, c: c.decode(c.encode(x, k)), static_argnums=2)
    assert_same_bytes(f(x, KEY, codec), codec.decode(p))


def _params(codec):
    import dataclasses

    return {f.name: getattr(codec, f.name) for f in dataclasses.fields(codec)}


@codecs
@dtypes
def test_all_zero_decodes_to_zero(codec, dtype):
    x = jnp.zeros((1000,), dtype)
    y = decode(encode(x, KEY, codec))
    assert not np.any(np.isnan(np.asarray(y, np.float32)))
    assert np.all(np.asarray(y, np.float32) == 0)


@codecs
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_inputs_propagate(codec, bad):
    """A NaN or +-inf input never decodes to a finite value at its position
    (training code must see it). Other values of the same bucket may become
    NaN too: docs/codecs.md."""
    x = np.array(gradient_like(1000, seed=5))
    pos = [0, 333, 999]
    x[pos] = bad
    y = np.asarray(decode(encode(jnp.asarray(x), KEY, codec)), np.float32)
    assert not np.any(np.isfinite(y[pos]))


@codecs
def test_deterministic_codecs_ignore_the_key(codec):
    x = gradient_like(700, seed=9)
    if codec.stochastic:
        with pytest.raises(ValueError, match="PRNG key"):
            codec.encode(x)
        a = codec.encode(x, jax.random.key(1))
        b = codec.encode(x, jax.random.key(2))
        assert any(np.any(np.asarray(a[k]) != np.asarray(b[k])) for k in a.arrays)
    else:
        assert_same_payload(codec.encode(x), codec.encode(x, jax.random.key(5)))


@codecs
@pytest.mark.parametrize("dtype", ["int32", "bool", "uint8"])
def test_unsupported_dtype_is_a_type_error(codec, dtype):
    with pytest.raises(TypeError, match="unsupported dtype"):
        codec.encode(jnp.zeros((10,), dtype), KEY)
    with pytest.raises(TypeError, match="unsupported dtype"):
        jax.jit(lambda x: codec.encode(x, KEY).arrays)(jnp.zeros((10,), dtype))


@codecs
def test_decode_rejects_foreign_payloads(codec):
    p = jc.codecs.Identity().encode(jnp.ones(64))
    if codec != jc.codecs.Identity():
        with pytest.raises(ValueError):
            codec.decode(p)
    with pytest.raises(TypeError):
        codec.decode({"values": jnp.ones(3)})


@pytest.mark.parametrize(
    "make, param",
    [
        (lambda: jc.codecs.QSGD(bits=5), "bits"),
        (lambda: jc.codecs.QSGD(bits=1), "bits"),
        (lambda: jc.codecs.QSGD(bits=4.0), "bits"),
        (lambda: jc.codecs.QSGD(bucket_size=100), "bucket_size"),
        (lambda: jc.codecs.QSGD(bucket_size=4), "bucket_size"),
        (lambda: jc.codecs.QSGD(bucket_size=1 << 17), "bucket_size"),
        (lambda: jc.codecs.QSGD(norm="l1"), "norm"),
        (lambda: jc.codecs.OneBit(bucket_size=0), "bucket_size"),
        (lambda: jc.codecs.Int8(bucket_size=3), "bucket_size"),
        (lambda: jc.codecs.Int8(bucket_size=True), "bucket_size"),
        (lambda: jc.codecs.Cast("int8"), "dtype"),
        (lambda: jc.codecs.Cast("float32"), "dtype"),
        (lambda: jc.codecs.get("nope"), "unknown codec"),
    ],
)
def test_invalid_configuration_names_the_parameter(make, param):
    with pytest.raises(ValueError, match=param):
        make()


def test_structural_parameters_are_keyword_only():
    with pytest.raises(TypeError):
        jc.codecs.QSGD(4)  # type: ignore[misc]


def test_backend_argument_is_validated():
    with pytest.raises(ValueError, match="backend"):
        jc.codecs.Int8().encode(jnp.ones(8), backend="cuda")


def test_env_var_selects_the_twins(monkeypatch):
    monkeypatch.setenv("JAXCOMP_BACKEND", "xla")
    lowered = jax.jit(lambda x: jc.codecs.Int8().encode(x).arrays).lower(jnp.ones(4096))
    assert "jaxcomp_int8_encode" not in lowered.as_text()
    monkeypatch.setenv("JAXCOMP_BACKEND", "bogus")
    with pytest.raises(ValueError, match="JAXCOMP_BACKEND"):
        jc.codecs.Int8().encode(jnp.ones(8))


@needs_ffi
def test_auto_uses_the_kernel_on_cpu(monkeypatch):
    monkeypatch.delenv("JAXCOMP_BACKEND", raising=False)
    lowered = jax.jit(lambda x: jc.codecs.Int8().encode(x).arrays).lower(jnp.ones(4096))
    assert "jaxcomp_int8_encode" in lowered.as_text()


def test_bits_per_element():
    assert jc.codecs.QSGD(bits=4, bucket_size=512).bits_per_element() == pytest.approx(4 + 32 / 512)
    assert jc.codecs.OneBit(bucket_size=64).bits_per_element() == pytest.approx(1 + 64 / 64)
    assert jc.codecs.Int8(bucket_size=512).bits_per_element() == pytest.approx(8 + 32 / 512)
    assert jc.codecs.Cast("bfloat16").bits_per_element() == 16
    assert jc.codecs.Identity().bits_per_element() == 32
