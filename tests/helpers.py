"""Shared test helpers: input generators and byte-level comparison."""

from __future__ import annotations

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np


def gradient_like(n: int, seed: int = 0, dtype="float32") -> jnp.ndarray:
    """Heavy-tailed values over several orders of magnitude, with exact
    zeros, negative zeros and float32 subnormals mixed in."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 2.0)
    x = x.astype(np.float32)
    if n >= 8:
        x[rng.integers(0, n, size=max(1, n // 50))] = 0.0
        x[rng.integers(0, n, size=max(1, n // 50))] = -0.0
        x[rng.integers(0, n, size=max(1, n // 100))] = np.float32(3e-39)  # subnormal
    return jnp.asarray(x).astype(dtype)


def as_bytes(a) -> bytes:
    return np.asarray(a).tobytes()


def assert_same_bytes(a, b, what: str = "") -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    )
    if a.tobytes() != b.tobytes():
        ua = a.reshape(-1).view(np.uint8 if a.dtype.itemsize == 1 else f"u{a.dtype.itemsize}")
        ub = b.reshape(-1).view(ua.dtype)
        bad = np.nonzero(ua != ub)[0]
        raise AssertionError(
            f"{what}: {bad.size} elements differ, first at {bad[:5]}: {a.reshape(-1)[bad[:5]]} vs {b.reshape(-1)[bad[:5]]}"
        )


def assert_same_payload(p, q, what: str = "") -> None:
    assert p.codec == q.codec and p.shape == q.shape and p.dtype == q.dtype
    assert list(p.arrays) == list(q.arrays)
    for k in p.arrays:
        assert_same_bytes(p[k], q[k], f"{what} array {k!r}")


@functools.partial(jax.jit, static_argnames=("codec", "backend"))
def encode(x, key, codec, backend="auto"):
    """Jitted encode (one compile per codec, backend and shape)."""
    return codec.encode(x, key, backend=backend)


@functools.partial(jax.jit, static_argnames=("backend",))
def decode(payload, backend="auto"):
    return payload.codec.decode(payload, backend=backend)


def free_port() -> int:
    """A free TCP port on loopback (for a jax.distributed coordinator)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a worker process: this process's flags (CI's
    optimization level, say) without its simulated device count, and
    ``devices`` simulated CPU devices if given."""
    import os

    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


def worker_env(root, devices: int | None = None) -> dict:
    """The environment of a worker process on the CPU: this one's, with
    :func:`worker_xla_flags` and the checkout ``root`` first on the path
    (the workers import the checkout's jaxcomp and tests' modules)."""
    import os

    return {
        **os.environ,
        "XLA_FLAGS": worker_xla_flags(devices),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
    }


def run_processes(commands, envs, *, timeout: float, cwd=None) -> list[str]:
    """Runs one process per command (``envs[i]`` its environment) at once,
    each bounded by ``timeout`` seconds, and kills whatever is left.

    Returns:
      Every process's output (stdout and stderr together).
    Raises:
      AssertionError: a process failed or timed out, with its output's tail.
    """
    import subprocess

    procs = [
        subprocess.Popen(
            [str(c) for c in cmd],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for cmd, env in zip(commands, envs, strict=True)
    ]
    outputs = []
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outputs.append(p.communicate()[0] + f"\n[timed out after {timeout} s]")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{outputs[i][-4000:]}"
    return outputs


def auto_mesh(shape=(8,), names=("data",)):
    """A mesh of the first prod(shape) devices, every axis Auto."""
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def mlp_loss(params, batch):
    """The small regression MLP the data_parallel tests train."""
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] - y) ** 2)


def long_scan_options(steps: int) -> dict | None:
    """``jax.jit``'s ``compiler_options`` for a scan of ``steps`` training
    steps: XLA's default optimization level from 200 steps on, where the
    run is long enough to pay for the optimizations' compile time (CI
    compiles the suite at level 0: docs/development.md, "The tier flags");
    None (the process's level) for shorter ones."""
    return {"xla_backend_optimization_level": 3} if steps >= 200 else None


def registered_targets(folder: str, suffix: str) -> set[str]:
    """The codec names whose ``jaxcomp_<name>_<suffix>`` target (declared in
    ffi/include/jaxcomp) the sources of ``folder`` (``ffi`` or ``cuda``)
    register: what a codec's kernel flags must name."""
    root = pathlib.Path(__file__).parent.parent
    constants = {}
    for header in (root / "ffi" / "include" / "jaxcomp").glob("*.h"):
        for const, name in re.findall(
            rf'Target (\w+)\{{"jaxcomp_(\w+)_{suffix}"', header.read_text()
        ):
            constants[const] = name
    registered = set()
    for source in (root / folder).glob("*.c[cu]"):
        registered |= set(re.findall(r"JAXCOMP_REGISTER\((\w+)", source.read_text()))
    return {name for const, name in constants.items() if const in registered}


def run_benchmark_smoke(script: str, out) -> None:
    """Runs ``benchmarks/<script> --smoke --json <out>`` from the repository
    root on the CPU (the script bounds its own processes with ``timeout``
    and kills what is left; this bounds the script) and asserts that it
    exited cleanly."""
    import os
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, root / "benchmarks" / script, "--smoke", "--json", out],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
