"""The contract every registered codec passes: layout and byte accounting,
kernel == twin byte for byte (sizes at bucket edges and across the kernels'
threads, each dtype), jit / eager / vmap, special values, keys, errors and
the wire round trip.

Parametrized by the codec registry (each codec's ``examples(coverage=True)``)
only: sizes and dtypes vary inside a test where they change the code path
(parameters multiply only where they change it; one oracle pins each
property once), so a new codec is tested by being registered. The golden
vectors (test_golden.py) pin the bytes themselves.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONTRACT_CODECS, codec_id
from helpers import assert_same_bytes, assert_same_payload, decode, encode, gradient_like

import jaxcomp as jc
import jaxcomp._ffi
from jaxcomp import wire
from jaxcomp.codecs import Rate

KEY = jax.random.key(42)
needs_ffi = pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")
codecs = pytest.mark.parametrize("codec", CONTRACT_CODECS, ids=codec_id)


def _edge(codec) -> int:
    """The size at which the codec's payload changes shape: its split
    granularity (bucket), or 64 for whole-tensor codecs."""
    g = codec.split_granularity() or 64
    return g if g > 1 else 64


def bit_identity_cases(codec) -> list[tuple[int, str]]:
    """(n, dtype) pairs: a single value; one past a bucket edge; an odd size
    spanning many buckets with a partial last one; and one large enough to
    spread over several threads of the CPU kernels (65536 elements per
    task). Each dtype once with more than one bucket."""
    return [
        (1, "bfloat16"),
        (_edge(codec) + 1, "float16"),
        (4099, "float32"),
        (3 * 65536 + 13, "float16"),
    ]


# ---------------------------------------------------------------------------
# Layout and accounting
# ---------------------------------------------------------------------------
@codecs
def test_layout_and_byte_accounting(codec):
    cases = [((), "float32"), ((0,), "bfloat16"), ((3, 5, 7), "float16"), ((2, 1000), "float32")]
    for shape, dtype in cases:
        x = gradient_like(int(np.prod(shape)), seed=1, dtype=dtype).reshape(shape)
        p = encode(x, KEY, codec)
        assert p.shape == shape and p.dtype == np.dtype(dtype)
        layout = codec.layout(shape, dtype)
        assert list(p.arrays) == list(layout)
        for name, spec in layout.items():
            assert p[name].shape == spec.shape and p[name].dtype == spec.dtype, name
        assert p.nbytes == codec.wire_nbytes(shape, dtype)
        bits = codec.bits_per_element(shape, dtype)
        assert bits * max(x.size, 1) == pytest.approx(8 * p.nbytes)
        if codec.rate is Rate.VARIABLE:  # part of a fixed-capacity buffer
            assert 0 < int(p.used_nbytes) <= p.nbytes
        else:
            assert int(p.used_nbytes) == p.nbytes
        y = decode(p)
        assert y.shape == shape and y.dtype == x.dtype


@codecs
def test_wire_round_trip(codec):
    for shape, dtype in [((0,), "float16"), ((), "bfloat16"), ((3, 5, 7), "float32")]:
        x = gradient_like(int(np.prod(shape)), seed=2, dtype=dtype).reshape(shape)
        p = encode(x, KEY, codec)
        b = wire.to_bytes(p)
        assert len(b) == wire.serialized_nbytes(codec, shape, dtype)
        q = wire.from_bytes(b)
        assert_same_payload(p, q, f"{shape} {dtype}")
        assert wire.to_bytes(q) == b
        assert_same_bytes(decode(q), decode(p), "decode after the round trip")
    assert type(codec).from_wire_params(codec.wire_params()) == codec


@codecs
def test_split_granularity_cuts_payloads(codec):
    """Where the codec says its payload splits every g values, each slice of
    the payload of 6 g values is a payload of 2 g values that decodes to that
    part of the tensor (what two-phase's one encoding per tensor relies on)."""
    g = codec.split_granularity()
    if g is None:
        pytest.skip("whole-tensor payload")
    p = encode(gradient_like(6 * g, seed=4), KEY, codec)
    whole = np.asarray(decode(p))
    for i in range(3):
        part = {k: a.reshape(3, -1)[i] for k, a in p.arrays.items()}
        y = codec.decode(codec.payload(part, (2 * g,), p.dtype))
        assert_same_bytes(y, whole[2 * g * i : 2 * g * (i + 1)], f"part {i}")


# ---------------------------------------------------------------------------
# Kernel == twin
# ---------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("codec",))
def _kernel_and_twin(x, key, codec):
    """The kernel's and the twin's encode of x, and both decodes of the
    kernel's payload, in one compiled program."""
    p = codec.encode(x, key, backend="ffi")
    q = codec.encode(x, key, backend="xla")
    return p, q, codec.decode(p, backend="ffi"), codec.decode(p, backend="xla")


@needs_ffi
@codecs
def test_kernel_and_twin_give_the_same_bytes(codec):
    for n, dtype in bit_identity_cases(codec):
        x = gradient_like(n, seed=n, dtype=dtype)
        key = jax.random.fold_in(KEY, n)
        p, q, y_ffi, y_xla = _kernel_and_twin(x, key, codec)
        assert_same_payload(p, q, f"{dtype} n={n} encode")
        assert_same_bytes(y_ffi, y_xla, f"{dtype} n={n} decode")


@needs_ffi
@codecs
def test_jit_eager_and_vmap_agree(codec):
    """The kernel eager and under jit, and vmap (one batched kernel call)
    against the examples one by one. (The twins op by op: test_golden.)"""
    x = gradient_like(3001, seed=7, dtype="bfloat16")
    p = codec.encode(x, KEY, backend="ffi")
    assert_same_payload(p, encode(x, KEY, codec, "ffi"), "eager vs jit kernel")
    assert_same_bytes(codec.decode(p, backend="ffi"), decode(p, "xla"), "eager decode")
    xs = jnp.stack([gradient_like(300, seed=s) for s in range(3)])
    keys = jax.random.split(KEY, 3)
    for backend in ("ffi", "xla"):
        enc = jax.jit(jax.vmap(lambda x, k, b=backend: codec.encode(x, k, backend=b)))
        dec = jax.jit(jax.vmap(lambda p, b=backend: codec.decode(p, backend=b)))
        ps = enc(xs, keys)
        ys = dec(ps)
        for i in range(3):
            # The reference one by one: the twin under jit (op by op it gives
            # the same bytes: test_golden.py), compiled once for the three.
            one = encode(xs[i], keys[i], codec, "xla")
            for name in one.arrays:
                assert_same_bytes(ps[name][i], one[name], f"{backend} example {i} {name}")
            assert_same_bytes(ys[i], decode(one, "xla"), f"{backend} decode {i}")


@needs_ffi
@pytest.mark.parametrize("name", ["qsgd", "threelc", "topk"])
def test_a_program_exported_for_cpu_and_cuda_runs_the_kernel_on_the_cpu(name):
    """A kernel call lowers one branch per platform (a twin traced only
    then): exported for the CPU and CUDA, the module holds the CPU kernel
    and the CUDA branch (the twin where no CUDA kernels are built, as on a
    CPU-only machine), and run on the CPU it gives the kernel's bytes. The
    same program lowered for the CPU alone holds no conditional."""
    codec = jc.codecs.get(name)
    x = gradient_like(3001, seed=3)

    def f(x, key):
        p = codec.encode(x, key)
        return (*p.arrays.values(), codec.decode(p))

    # The kernels are this project's, not ones with JAX's compatibility promise.
    checks = [
        jax.export.DisabledSafetyCheck.custom_call(f"jaxcomp_{name}_{op}")
        for op in ("encode", "decode")
    ]
    exported = jax.export.export(jax.jit(f), platforms=("cpu", "cuda"), disabled_checks=checks)(
        x, KEY
    )
    text = exported.mlir_module()
    assert f"jaxcomp_{name}_encode" in text and "stablehlo.case" in text
    for got, want in zip(exported.call(x, KEY), f(x, KEY), strict=True):
        assert_same_bytes(got, want, f"{name} exported")
    cpu_only = jax.jit(f).lower(x, KEY).as_text()
    assert f"jaxcomp_{name}_encode" in cpu_only and "stablehlo.case" not in cpu_only


# ---------------------------------------------------------------------------
# Special values, keys, static config
# ---------------------------------------------------------------------------
@codecs
def test_zeros_decode_to_zero_and_non_finite_values_propagate(codec):
    for dtype in ("float32", "bfloat16", "float16"):
        y = decode(encode(jnp.zeros((1000,), dtype), KEY, codec))
        assert np.all(np.asarray(y, np.float32) == 0), dtype
    # A NaN or +-inf input never decodes to a finite value at its position
    # (training code must see it); other values of its bucket may become NaN
    # too (docs/codecs.md).
    pos = [0, 333, 999]
    for bad in (np.nan, np.inf, -np.inf):
        x = np.array(gradient_like(1000, seed=5))
        x[pos] = bad
        y = np.asarray(decode(encode(jnp.asarray(x), KEY, codec)), np.float32)
        assert not np.any(np.isfinite(y[pos])), bad


@codecs
def test_keys(codec):
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
def test_config_is_static_hashable_and_found_by_name(codec):
    x = gradient_like(100, seed=3)
    p = codec.encode(x, KEY)
    leaves, treedef = jax.tree_util.tree_flatten(p)
    assert len(leaves) == len(p.arrays)
    assert_same_payload(p, jax.tree_util.tree_unflatten(treedef, leaves))
    params = {f.name: getattr(codec, f.name) for f in dataclasses.fields(codec)}
    assert jc.codecs.get(codec.name, **params) == codec
    assert hash(jc.codecs.get(codec.name, **params)) == hash(codec)
    f = jax.jit(lambda x, k, c: c.decode(c.encode(x, k)), static_argnums=2)
    assert_same_bytes(f(x, KEY, codec), codec.decode(p))
    assert codec in type(codec).examples(coverage=True)


@codecs
def test_errors(codec):
    for dtype in ("int32", "bool", "uint8"):
        with pytest.raises(TypeError, match="unsupported dtype"):
            codec.encode(jnp.zeros((10,), dtype), KEY)
        with pytest.raises(TypeError, match="unsupported dtype"):
            jax.jit(lambda x: codec.encode(x, KEY).arrays)(jnp.zeros((10,), dtype))
    if codec != jc.codecs.Identity():
        with pytest.raises(ValueError):
            codec.decode(jc.codecs.Identity().encode(jnp.ones(64)))
    with pytest.raises(TypeError):
        codec.decode({"values": jnp.ones(3)})
    p = codec.encode(gradient_like(64, seed=1), KEY)
    batched = jax.tree.map(lambda a: jnp.stack([a, a]), p)
    with pytest.raises(ValueError, match=r"jax\.vmap"):
        codec.decode(batched)


# ---------------------------------------------------------------------------
# The registry and configuration
# ---------------------------------------------------------------------------
def test_registry_is_complete_and_consistent():
    classes = jc.codecs.registered()
    assert [c.codec_id for c in classes] == sorted({c.codec_id for c in classes})
    for cls in classes:
        assert getattr(jc.codecs, cls.__name__) is cls
        assert jc.codecs.get(cls.name) == cls()
        assert isinstance(cls.rate, Rate)
        users = cls.examples()
        assert users and set(users) <= set(cls.examples(coverage=True))
        if cls.rate is Rate.VARIABLE:
            assert issubclass(cls, jc.codecs.VariableRateCodec)
        if cls.rate is Rate.SPARSE:
            assert issubclass(cls, jc.codecs.SparseCodec)


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
        (lambda: jc.codecs.get("qsgd:bits"), "key=value"),
        (lambda: jc.codecs.get("qsgd:bits=5"), "bits"),
    ],
)
def test_invalid_configuration_names_the_parameter(make, param):
    with pytest.raises(ValueError, match=param):
        make()


def test_spec_strings_and_aliases():
    get = jc.codecs.get
    assert get("qsgd:bits=4,bucket_size=512") == jc.codecs.QSGD(bits=4, bucket_size=512)
    assert get("QSGD: bits = 2 , norm = l2") == jc.codecs.QSGD(bits=2, norm="l2")
    assert get("qsgd:bits=2", bits=8) == jc.codecs.QSGD(bits=8)  # keywords win
    assert get("natural:stochastic=false") == jc.codecs.Natural(stochastic=False)
    assert get("topk:k_per_bucket=8x512") == jc.codecs.TopK(k_per_bucket=(8, 512))
    assert get("topk:fraction=0.05") == jc.codecs.TopK(fraction=0.05)
    assert get("threelc:sparsity=1.5,capacity=none") == jc.codecs.ThreeLC(sparsity=1.5)
    assert get("bf16") == get("bfloat16") == jc.codecs.Cast("bfloat16")
    assert get("fp16") == get("f16") == jc.codecs.Cast("float16")
    assert get("1bit") == get("1-bit") == jc.codecs.OneBit()
    assert get("3lc:sparsity=1.5") == jc.codecs.ThreeLC(sparsity=1.5)
    assert get("sign") == jc.codecs.SignSGD()
    assert get("mxfp8") == jc.codecs.MX() and get("mxfp4") == jc.codecs.MX(element="e2m1")
    assert get("mxfp6:stochastic=true") == jc.codecs.MX(element="e2m3", stochastic=True)
    assert get("fp8:format=e5m2,bucket_size=64") == jc.codecs.FP8(format="e5m2", bucket_size=64)
    nested = get("topk:fraction=0.01,value_codec=(qsgd:bits=8,bucket_size=64)")
    assert nested == jc.codecs.TopK(
        fraction=0.01, value_codec=jc.codecs.QSGD(bits=8, bucket_size=64)
    )
    with pytest.raises(ValueError, match="bf16 = cast:dtype=bfloat16"):
        get("int4")  # the error lists the aliases with what they stand for
    with pytest.raises(ValueError, match="parentheses"):
        get("topk:value_codec=(qsgd:bits=8")
    # Classes (their defaults, or the keywords) and codecs go through as well.
    assert get(jc.codecs.QSGD) == jc.codecs.QSGD()
    assert get(jc.codecs.QSGD, bits=2) == jc.codecs.QSGD(bits=2)
    codec = jc.codecs.Int8(bucket_size=64)
    assert get(codec) is codec and get(codec, bucket_size=8) == jc.codecs.Int8(bucket_size=8)
    with pytest.raises(TypeError, match="spec string"):
        get(4)  # type: ignore[arg-type]


@codecs
def test_codecs_print_as_specs_that_get_reads_back(codec):
    assert str(codec) == codec.spec and codec.spec.startswith(codec.name)
    assert jc.codecs.get(codec.spec) == codec


def test_structural_parameters_are_keyword_only():
    with pytest.raises(TypeError):
        jc.codecs.QSGD(4)  # type: ignore[misc]


def test_backend_argument_is_validated():
    with pytest.raises(ValueError, match="backend"):
        jc.codecs.Int8().encode(jnp.ones(8), backend="cuda")


def test_env_var_selects_the_twins(monkeypatch):
    """JAXCOMP_BACKEND, read when jaxcomp is imported, is the default of
    "auto": as another process starts with it, here by the value it left."""
    monkeypatch.setattr(jaxcomp._ffi, "_DEFAULT", "xla")
    lowered = jax.jit(lambda x: jc.codecs.Int8().encode(x).arrays).lower(jnp.ones(4096))
    assert "jaxcomp_int8_encode" not in lowered.as_text()
    monkeypatch.setattr(jaxcomp._ffi, "_DEFAULT", "bogus")
    with pytest.raises(ValueError, match=r"JAXCOMP_BACKEND.*read when jaxcomp was imported"):
        jc.codecs.Int8().encode(jnp.ones(8))


def test_environment_is_read_once_at_import():
    """A process started with JAXCOMP_BACKEND=xla runs the twins; setting it
    after the import changes nothing (what jit caches does not depend on it)."""
    code = (
        "import os, jax, jax.numpy as jnp, jaxcomp as jc\n"
        "os.environ['JAXCOMP_BACKEND'] = 'ffi'\n"
        "t = jax.jit(lambda x: jc.codecs.Int8().encode(x).arrays).lower(jnp.ones(4096)).as_text()\n"
        "print('kernel' if 'jaxcomp_int8_encode' in t else 'twin')\n"
    )
    env = {**os.environ, "JAXCOMP_BACKEND": "xla", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "twin", out.stderr[-2000:]


def test_every_codec_method_takes_the_same_backends():
    codec, x = jc.codecs.Int8(), jnp.ones(512)
    for backend in ("auto", "ffi", "xla", "fused"):
        p = codec.encode(x, backend=backend)
        codec.decode(p, backend=backend)
        codec.encode_feedback(x, jnp.zeros(512), backend=backend)
    with pytest.raises(ValueError, match="backend must be one of"):
        codec.encode_feedback(x, jnp.zeros(512), backend="cuda")


@needs_ffi
def test_auto_uses_the_kernel_on_cpu(monkeypatch):
    monkeypatch.setattr(jaxcomp._ffi, "_DEFAULT", "auto")
    lowered = jax.jit(lambda x: jc.codecs.Int8().encode(x).arrays).lower(jnp.ones(4096))
    assert "jaxcomp_int8_encode" in lowered.as_text()


@functools.cache
def _bits(codec):
    return codec.bits_per_element()


def test_bits_per_element():
    assert _bits(jc.codecs.QSGD(bits=4, bucket_size=512)) == pytest.approx(4 + 32 / 512)
    assert _bits(jc.codecs.OneBit(bucket_size=64)) == pytest.approx(1 + 64 / 64)
    assert _bits(jc.codecs.Int8(bucket_size=512)) == pytest.approx(8 + 32 / 512)
    assert _bits(jc.codecs.Cast("bfloat16")) == 16
    assert _bits(jc.codecs.Identity()) == 32
