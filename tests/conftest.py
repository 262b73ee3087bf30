"""Test configuration: 8 simulated host devices, JAX's default platform the
CPU also where a GPU is present, shared codec lists."""

import importlib.metadata
import os
import re


def _cuda_machine() -> bool:
    """A CUDA plugin for jax is installed and an NVIDIA device is present."""
    plugin = any(
        re.fullmatch(r"jax[-_]cuda\d+[-_]plugin", d.metadata["Name"] or "")
        for d in importlib.metadata.distributions()
    )
    return plugin and os.path.exists("/dev/nvidiactl")


# Must happen before jax is imported anywhere. The suite's arrays, meshes and
# subprocesses live on the CPU, as on a machine without a GPU; the tests of
# the GPU (test_gpu.py and the `gpu` marker) ask for jax.devices("cuda").
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "JAX_PLATFORMS" not in os.environ and _cuda_machine():
    os.environ["JAX_PLATFORMS"] = "cpu,cuda"
# jax 0.11's XLA crashes (a segmentation fault in Shardy's canonicalizer,
# ManualComputationUnusedInputsPattern) while compiling some shard_map
# programs with inputs the body does not use: 23 optax and collectives tests
# on jax 0.11.2; none on 0.10.2 or 0.12. The GSPMD partitioner compiles them
# (docs/gpu.md, "Known issues").
if importlib.metadata.version("jax").startswith("0.11."):
    os.environ.setdefault("JAX_USE_SHARDY_PARTITIONER", "false")

import jax  # noqa: E402
import pytest  # noqa: E402

import jaxcomp as jc  # noqa: E402

if os.environ.get("JAXCOMP_REQUIRE_KERNELS") == "1" and not jc.cpu_available():
    raise RuntimeError(
        "JAXCOMP_REQUIRE_KERNELS=1 but the CPU kernels are not importable: the tests would "
        f"silently run the pure-JAX twins only: {jc._ffi.kernels_line()}"
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
