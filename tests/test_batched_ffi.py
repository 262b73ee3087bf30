"""Batched FFI calls: under jax.vmap every kernel runs as one custom call over
buffers with leading batch dimensions (ffi_call's vmap_method="broadcast_all"),
and each entry of the batch gets exactly the bytes of an unbatched call."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import codec_id
from helpers import assert_same_bytes, assert_same_payload, gradient_like

import jaxcomp as jc

pytestmark = pytest.mark.skipif(not jc.cpu_available(), reason="CPU kernels not built")

KEY = jax.random.key(7)
# A handler's INVALID_ARGUMENT reaches a jitted call as ValueError, an eager
# one as JaxRuntimeError.
HANDLER_ERRORS = (jax.errors.JaxRuntimeError, ValueError)
N = 2053  # several buckets of 512 and a partial last one
BATCH = 3

# The first example of every codec that runs a kernel (all but the linear
# Identity), and TopK with a quantized value stage: a new codec is covered
# without an edit here.
CASES = [
    cls.examples()[0] for cls in jc.codecs.registered() if cls.rate is not jc.codecs.Rate.LINEAR
] + [jc.codecs.TopK(fraction=0.05, value_codec=jc.codecs.QSGD(bits=4))]
codecs = pytest.mark.parametrize("codec", CASES, ids=codec_id)
backends = pytest.mark.parametrize("backend", ["ffi", "xla"])


def _inputs(batch_shape: tuple[int, ...]):
    count = int(np.prod(batch_shape))
    xs = jnp.stack([gradient_like(N, seed=s) for s in range(count)])
    keys = jax.random.split(KEY, count)
    return xs.reshape(*batch_shape, N), keys.reshape(batch_shape)


@functools.cache
def _encoder(codec, backend: str, levels: int):
    f = lambda x, k: codec.encode(x, k, backend=backend)  # noqa: E731
    for _ in range(levels):
        f = jax.vmap(f)
    return jax.jit(f)


@functools.cache
def _decoder(codec, backend: str, levels: int):
    f = lambda p: codec.decode(p, backend=backend)  # noqa: E731
    for _ in range(levels):
        f = jax.vmap(f)
    return jax.jit(f)


def _check_entries(codec, backend: str, batch_shape: tuple[int, ...]) -> None:
    xs, keys = _inputs(batch_shape)
    levels = len(batch_shape)
    payloads = _encoder(codec, backend, levels)(xs, keys)
    outs = _decoder(codec, backend, levels)(payloads)
    for index in np.ndindex(*batch_shape):
        single = _encoder(codec, backend, 0)(xs[index], keys[index])
        entry = jax.tree.map(lambda a, index=index: a[index], payloads)
        assert_same_payload(entry, single, f"encode, entry {index}")
        want = _decoder(codec, backend, 0)(single)
        assert_same_bytes(outs[index], want, f"decode, entry {index}")


@backends
@codecs
def test_vmap_matches_per_example(codec, backend):
    _check_entries(codec, backend, (BATCH,))


@backends
def test_nested_vmap_matches_per_example(backend):
    _check_entries(jc.codecs.QSGD(bits=4), backend, (2, 2))


def _custom_calls(text: str, target: str = r"jaxcomp_\w+") -> list[str]:
    return [line for line in text.splitlines() if re.search(rf"custom_call @{target}\(", line)]


@codecs
def test_vmapped_encode_is_one_custom_call(codec):
    xs, keys = _inputs((BATCH,))
    text = _encoder(codec, "ffi", 1).lower(xs, keys).as_text()
    calls = _custom_calls(text)
    assert calls and "while" not in text, text
    # Batched in place: each call takes the leading batch dimension (a
    # sequential vmap would loop over unbatched calls instead).
    for call in calls:
        assert f"tensor<{BATCH}x" in call, call


def test_nested_vmap_is_one_custom_call():
    xs, keys = _inputs((2, 2))
    codec = jc.codecs.QSGD(bits=4)
    calls = _custom_calls(
        _encoder(codec, "ffi", 2).lower(xs, keys).as_text(), "jaxcomp_qsgd_encode"
    )
    assert len(calls) == 1, calls
    assert "tensor<2x2x" in calls[0], calls[0]


# Entries of 2^16 elements or more run one after the other, each split across
# the threads; smaller ones run side by side, one thread each.
@pytest.mark.parametrize(
    "codec",
    [jc.codecs.QSGD(bits=4), jc.codecs.ThreeLC(), jc.codecs.TopK(fraction=0.01)],
    ids=codec_id,
)
def test_large_entries_match_per_example(codec):
    xs = jnp.stack([gradient_like(70001, seed=s) for s in range(2)])
    keys = jax.random.split(KEY, 2)
    payloads = _encoder(codec, "ffi", 1)(xs, keys)
    outs = _decoder(codec, "ffi", 1)(payloads)
    for i in range(2):
        single = _encoder(codec, "ffi", 0)(xs[i], keys[i])
        assert_same_payload(jax.tree.map(lambda a, i=i: a[i], payloads), single, f"entry {i}")
        assert_same_bytes(outs[i], _decoder(codec, "ffi", 0)(single), f"decode, entry {i}")


def test_buffers_with_different_batch_dims_are_rejected():
    """Calls that jax.vmap did not make: the handler checks that every buffer
    has the same leading dimensions before it reads any of them."""
    call = jax.ffi.ffi_call(
        "jaxcomp_int8_encode",
        (
            jax.ShapeDtypeStruct((2, 1024), jnp.int8),
            jax.ShapeDtypeStruct((2, 2), jnp.float32),
        ),
    )
    x = jnp.ones((3, 1024), jnp.float32)
    with pytest.raises(HANDLER_ERRORS, match=r"jaxcomp_int8_encode: .*batch"):
        jax.block_until_ready(call(x, bucket_size=np.int64(512)))


def test_a_corrupted_entry_fails_the_batched_decode():
    """The CPU ThreeLC decoder raises on a corrupted stream (the twin gives
    NaN); in a batch, one corrupted entry fails the whole call."""
    codec = jc.codecs.ThreeLC()
    xs, keys = _inputs((BATCH,))
    payloads = _encoder(codec, "ffi", 1)(xs, keys)
    arrays = payloads.arrays
    arrays["length"] = arrays["length"].at[1].set(-1)
    bad = jc.Payload(payloads.codec, payloads.shape, payloads.dtype, arrays)
    twin = np.asarray(_decoder(codec, "xla", 1)(bad))
    assert np.all(np.isnan(twin[1])) and not np.any(np.isnan(twin[0]))
    with pytest.raises(HANDLER_ERRORS, match="jaxcomp_threelc_decode: corrupted stream"):
        jax.block_until_ready(_decoder(codec, "ffi", 1)(bad))
