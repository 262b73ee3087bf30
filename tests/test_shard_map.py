"""Codecs inside jax.shard_map (8 simulated devices, check_vma on): the
kernels' outputs are typed per-device like the twins', and every device
encodes its own shard exactly as it would alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CONTRACT_CODECS, codec_id
from helpers import assert_same_bytes, gradient_like
from jax.sharding import PartitionSpec as P

N_DEV = 8


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N_DEV:
        pytest.skip(f"needs {N_DEV} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.mark.parametrize("codec", CONTRACT_CODECS, ids=codec_id)
def test_encode_decode_per_device(mesh, codec):
    """backend "auto" traces both the kernel and the twin (one branch per
    platform), so both must type their outputs per device."""
    backend = "auto"
    x = gradient_like(N_DEV * 1000, seed=3).reshape(N_DEV, 1000)
    keys = jax.random.split(jax.random.key(0), N_DEV)

    def per_device(x, k):
        p = codec.encode(x[0], k[0], backend=backend)
        y = codec.decode(p, backend=backend)
        # As raw bits: assembling float outputs across devices may normalize
        # -0.0 and subnormals, which says nothing about the codec.
        return jax.lax.bitcast_convert_type(y, jnp.uint32)[None]

    f = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
    )
    y = f(x, keys)
    # The twin outside shard_map, compiled once for the eight calls (it
    # gives the same bytes eager and under jit: tests/test_golden.py).
    twin = jax.jit(lambda x, k: codec.decode(codec.encode(x, k, backend="xla"), backend="xla"))
    for d in range(N_DEV):
        expect = twin(x[d], keys[d])
        assert_same_bytes(np.asarray(y[d]).view(np.float32), expect, f"device {d}")
    assert np.asarray(y).shape == (N_DEV, 1000)
