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


# Every codec configuration the contract suite runs: each registered codec's
# coverage examples (jaxcomp/codecs/<name>.py), so a new codec is tested by
# being registered.
CONTRACT_CODECS = [c for cls in jc.codecs.registered() for c in cls.examples(coverage=True)]

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
