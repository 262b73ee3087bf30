"""Test configuration: 8 simulated host devices, shared codec lists."""

import os

# Must happen before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import pytest

import jaxcomp as jc

if os.environ.get("JAXCOMP_REQUIRE_KERNELS") == "1" and not jc.cpu_available():
    raise RuntimeError(
        "JAXCOMP_REQUIRE_KERNELS=1 but the CPU kernels are not importable: the tests would "
        "silently run the pure-JAX twins only (is the source tree shadowing the installed package?)"
    )


def codec_id(c) -> str:
    return repr(c).replace(" ", "")


# Every codec configuration the contract suite runs. Small buckets keep odd
# sizes spanning several buckets with a partial last one.
CONTRACT_CODECS = [
    jc.codecs.Identity(),
    jc.codecs.Cast("bfloat16"),
    jc.codecs.Cast("float16"),
    jc.codecs.Int8(bucket_size=64),
    jc.codecs.Int8(),
    jc.codecs.OneBit(),
    jc.codecs.OneBit(bucket_size=8),
    jc.codecs.QSGD(bits=2, bucket_size=128),
    jc.codecs.QSGD(bits=3, bucket_size=64),
    jc.codecs.QSGD(bits=4),
    jc.codecs.QSGD(bits=4, bucket_size=16, norm="l2"),
    jc.codecs.QSGD(bits=8, norm="l2"),
    jc.codecs.QSGD(bits=8, bucket_size=8),
    jc.codecs.TernGrad(),
    jc.codecs.TernGrad(bucket_size=16),
    jc.codecs.Natural(),
    jc.codecs.Natural(bucket_size=8),
    jc.codecs.Natural(stochastic=False),
    jc.codecs.Natural(stochastic=False, bucket_size=16),
    jc.codecs.ThreeLC(),
    jc.codecs.ThreeLC(sparsity=1.5),
    # Overflows on most inputs of more than a few hundred elements.
    jc.codecs.ThreeLC(sparsity=1.9, capacity=48),
    jc.codecs.TopK(fraction=0.01),
    jc.codecs.TopK(k_per_bucket=(8, 512)),
    jc.codecs.TopK(k_per_bucket=(3, 8)),
    jc.codecs.TopK(fraction=0.05, value_codec=jc.codecs.QSGD(bits=4)),
]

FLOAT_DTYPES = ["float32", "bfloat16", "float16"]


def pytest_collection_modifyitems(config, items):
    has_gpu = _gpu_backend()
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


def _gpu_backend() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False
