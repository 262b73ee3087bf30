"""The rule that picks a CUDA kernel or the twin on GPUs (``Codec.cuda_auto``),
read from programs lowered for CUDA on any machine.

With the CUDA kernels taken as built (``cuda_available`` patched: lowering
needs no GPU), a program exported for CUDA holds a codec's kernel for an
operation exactly where the codec's ``cuda_auto`` lists it, the twin
elsewhere; ``backend="ffi"`` holds the kernel regardless, and error
feedback's compression (``compress_kept``, what ``compress_gradients``
runs) holds the one-pass kernel where "encode_feedback" is listed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxcomp as jc
import jaxcomp._ffi
from jaxcomp.collectives import feedback as _feedback
from jaxcomp.ops import _dispatch

KEY = jax.random.key(0)
CODECS = [
    jc.codecs.QSGD(bits=4),
    jc.codecs.QSGD(bits=4, norm="l2"),
    jc.codecs.Int8(),
    jc.codecs.OneBit(),
    jc.codecs.SignSGD(),
    jc.codecs.FP8(),
    jc.codecs.MX(element="e2m1"),
    jc.codecs.Natural(),
    jc.codecs.TernGrad(),
    jc.codecs.Cast("bfloat16"),
    jc.codecs.Cast("float16"),
]


@pytest.fixture
def cuda_built(monkeypatch):
    monkeypatch.setattr(_dispatch, "cuda_available", lambda: True)


def _cuda_text(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _targets(text: str) -> set[str]:
    import re

    return set(re.findall(r"@?\"?(jaxcomp_[a-z0-9_]+)\"?", text)) - {"jaxcomp_platform_call"}


@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_auto_lowers_the_kernels_the_rule_lists(codec, cuda_built):
    x = jnp.linspace(-1.0, 1.0, 4096, dtype=jnp.float32)
    r = x * 0.25

    # the payload's shapes and dtypes: the decode is only lowered
    payload = jax.eval_shape(lambda x, key: codec.encode(x, key, backend="xla"), x, KEY)

    def encode(backend):
        return _targets(
            _cuda_text(lambda x, key: codec.encode(x, key, backend=backend).arrays, x, KEY)
        )

    def decode(backend):
        return _targets(_cuda_text(lambda p: codec.decode(p, backend=backend), payload))

    for op, targets in (("encode", encode), ("decode", decode)):
        kernel = targets("ffi")
        assert kernel, f"{codec} has no CUDA {op} target"
        assert targets("auto") == (kernel if op in codec.cuda_auto else set()), op
        # The collectives' fused decode is the twin on GPUs, whatever the rule.
        if op == "decode":
            assert targets("fused") == set()

    if not _feedback.one_pass(codec, jnp.float32):
        return

    def kept(x, r, key):
        p, new = _feedback.compress_kept(
            codec, x, r, key if codec.stochastic else None, jnp.float32
        )
        return (*p.arrays.values(), new)

    got = _targets(_cuda_text(kept, x, r, KEY))
    one_pass = codec.cuda_feedback_kernel and "encode_feedback" in codec.cuda_auto
    if one_pass:
        assert got == {f"jaxcomp_{codec.name}_encode_feedback"}
    else:
        assert got == (encode("ffi") if "encode" in codec.cuda_auto else set())


def test_the_declarations_are_consistent():
    """Each codec's ``kernels``: "auto" runs only CUDA kernels that exist,
    every codec has its encode and decode on both platforms, and the flags
    read from it agree with it."""
    for cls in jc.codecs.registered():
        k = cls.kernels
        assert k.cuda_auto <= k.cuda, cls
        assert {"encode", "decode"} <= k.cpu and {"encode", "decode"} <= k.cuda, cls
        for codec in cls.examples():
            assert codec.cuda_auto <= k.cuda, codec
            assert codec.decode_sum_kernel == ("decode_sum" in k.cpu), codec
            assert codec.cuda_decode_sum_kernel == ("decode_sum" in k.cuda), codec
            if codec.cuda_feedback_kernel:
                assert codec.feedback_kernel and "encode_feedback" in k.cuda, codec


def test_a_declaration_names_operations():
    with pytest.raises(ValueError, match="unknown operations"):
        jc.codecs.Kernels.of(cpu=("encode", "decode", "sum"))
    with pytest.raises(ValueError, match="lists kernels CUDA lacks"):
        jc.codecs.Kernels.of(cuda=("encode", "decode"), cuda_auto=("encode_feedback",))


@pytest.mark.parametrize(
    "backend, env, want",
    [
        ("auto", "auto", ("fused", False)),  # decode: the twin on GPUs
        ("ffi", "auto", ("ffi", True)),
        ("xla", "auto", ("xla", False)),
        ("fused", "auto", ("fused", False)),
        ("auto", "ffi", ("ffi", True)),
        ("auto", "xla", ("xla", False)),
        ("fused", "ffi", ("fused-ffi", False)),
    ],
)
def test_route_resolves_backend_and_environment(backend, env, want, monkeypatch):
    """``Codec.route``, the one place a kernel call is resolved: QSGD's
    decode (a CUDA kernel that "auto" does not run) and its encode (one it
    runs) under every backend and ``JAXCOMP_BACKEND``."""
    monkeypatch.setattr(jaxcomp._ffi, "_DEFAULT", env)  # JAXCOMP_BACKEND's value
    codec = jc.codecs.QSGD(bits=4)
    got = codec.route("decode", backend)
    assert (str(got[0]), got[1]) == want
    encode = codec.route("encode", backend)
    if want[0] == "fused" and backend == "auto":
        assert (str(encode[0]), encode[1]) == ("auto", True)
    # A kernel CUDA lacks is never run there, even under "ffi".
    onebit = jc.codecs.OneBit()
    route = onebit.route("decode_sum", backend)
    assert route[1] is False
    if want[0] == "ffi":
        assert str(route[0]) == "fused-ffi"
