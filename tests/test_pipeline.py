"""Decode-and-accumulate of the received chunks (``Codec.decode_sum``): the
kernel, its twin and the rows decoded and added in order give the same
bits, and the collectives sum received payloads with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import registered_targets
from jax.sharding import PartitionSpec as P

import jaxcomp as jc
from jaxcomp import collectives as jcc

# ---------------------------------------------------------------------------
# Decode-and-accumulate of the received chunks (Codec.decode_sum)
# ---------------------------------------------------------------------------
DECODE_SUM_CODECS = [
    c
    for cls in jc.codecs.registered()
    if "decode_sum" in cls.kernels.cpu
    for c in cls.examples(coverage=True)
]


@pytest.mark.parametrize("rows, n", [(1, 1000), (3, 4099), (8, 70001)])
@pytest.mark.parametrize("codec", DECODE_SUM_CODECS, ids=repr)
def test_decode_sum_kernel_twin_and_rows_agree(codec, rows, n):
    xs = jnp.asarray(np.random.default_rng(rows).laplace(size=(rows, n)).astype(np.float32))
    xs = xs.at[0, :5].set(jnp.asarray([0.0, -0.0, 1e-40, -3e38, 7.0]))
    keys = jax.random.split(jax.random.key(rows), rows)
    payloads = jax.jit(jax.vmap(lambda x, k: codec.encode(x, k)))(xs, keys)
    kernel = np.asarray(jax.jit(lambda p: codec.decode_sum(p, backend="ffi"))(payloads))
    twin = np.asarray(jax.jit(lambda p: codec.decode_sum(p, backend="xla"))(payloads))
    decoded = [
        np.asarray(codec.decode(jax.tree.map(lambda a, i=i: a[i], payloads))) for i in range(rows)
    ]
    by_rows = decoded[0]
    for d in decoded[1:]:
        by_rows = by_rows + d  # float32, left to right
    assert kernel.dtype == np.float32 and kernel.shape == (n,)
    assert kernel.tobytes() == twin.tobytes()
    assert kernel.tobytes() == by_rows.tobytes()


@pytest.mark.parametrize("codec", DECODE_SUM_CODECS, ids=repr)
def test_the_collectives_decode_sum_is_the_rows_sum(codec):
    """What the collectives sum received payloads with (the kernel on the
    CPU, lowered per platform) gives the rows decoded and added in order,
    whatever the order of the codec's payload arrays."""
    from jaxcomp.collectives import _decode

    xs = jnp.asarray(np.random.default_rng(5).laplace(size=(3, 4099)).astype(np.float32))
    keys = jax.random.split(jax.random.key(5), 3)
    payloads = jax.jit(jax.vmap(lambda x, k: codec.encode(x, k)))(xs, keys)
    got = np.asarray(jax.jit(_decode.decode_sum)(payloads))
    rows = [np.asarray(codec.decode(jax.tree.map(lambda a, i=i: a[i], payloads))) for i in range(3)]
    assert got.tobytes() == ((rows[0] + rows[1]) + rows[2]).tobytes()


def test_the_decode_sum_flags_name_the_kernels_the_sources_register():
    """``Codec.kernels`` says which codecs' ``decode_sum`` targets the CPU
    and CUDA modules compile: a declaration without its target would fail
    at run time, a target without its declaration would never run."""
    classes = jc.codecs.registered()
    assert {c.name for c in classes if "decode_sum" in c.kernels.cpu} == registered_targets(
        "ffi", "decode_sum"
    )
    assert {c.name for c in classes if "decode_sum" in c.kernels.cuda} == registered_targets(
        "cuda", "decode_sum"
    )
    assert {c.name for c in classes if "decode_sum" in c.kernels.cpu} >= {
        "qsgd", "int8", "onebit", "signsgd", "natural", "fp8", "mx", "terngrad", "cast"
    }  # fmt: skip


@pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")
def test_the_cpu_all_reduce_sums_the_received_payloads_in_the_kernel():
    """On the CPU the allgather sums every device's OneBit payload with the
    decode-and-accumulate kernel: no decoded row per device is written."""
    codec = jc.codecs.OneBit()
    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices("cpu")[:4])
    f = jax.jit(
        jax.shard_map(
            lambda x: jcc.pmean(x[0], "d", codec, algorithm="allgather").value[None],
            mesh=mesh,
            in_specs=P("d"),
            out_specs=P("d"),
        )
    )
    x = jax.device_put(
        jax.random.normal(jax.random.key(0), (4, 4096)), jax.sharding.NamedSharding(mesh, P("d"))
    )
    hlo = f.lower(x).compile().as_text()
    assert '"jaxcomp_onebit_decode_sum"' in hlo
    assert '"jaxcomp_onebit_decode"' not in hlo


def test_decode_sum_of_other_codecs_and_errors():
    codec = jc.codecs.Identity()  # no kernel of its own: rows, then the sum
    assert not codec.decode_sum_kernel
    xs = jax.random.normal(jax.random.key(0), (3, 1000))
    payloads = jax.vmap(codec.encode)(xs)
    want = sum(
        np.asarray(codec.decode(jax.tree.map(lambda a, i=i: a[i], payloads))) for i in range(3)
    )
    got = np.asarray(codec.decode_sum(payloads))
    np.testing.assert_array_equal(got, want.astype(np.float32))
    with pytest.raises(ValueError, match="float32 payloads"):
        codec.decode_sum(jax.vmap(codec.encode)(xs.astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="payload of"):
        jc.codecs.Cast(dtype="bfloat16").decode_sum(payloads)
