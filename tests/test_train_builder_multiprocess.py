"""jc.data_parallel across processes (jax.distributed on loopback, gloo CPU
collectives): the NNX digits CNN trained by 2 processes x 4 devices, each
process handing in its rows of every global batch, equals the hand-written
shard_map step bit for bit, resumes from a mid-run orbax checkpoint bit for
bit (tests/_builder_worker.py asserts both), and every process ends with the
same losses and parameters."""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.multiprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_builder_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_of_four_devices(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    num, local = 2, 4
    port = _free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={local}",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                *map(str, (port, num, i, local, tmp_path)),
                str(tmp_path / f"{i}.npz"),
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(num)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{outputs[i][-4000:]}"
    results = [np.load(tmp_path / f"{i}.npz") for i in range(num)]
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # it trains
    for r in results[1:]:
        np.testing.assert_array_equal(r["losses"], results[0]["losses"])
        np.testing.assert_array_equal(r["kernel"], results[0]["kernel"])
