"""jc.data_parallel across processes (jax.distributed on loopback, gloo CPU
collectives): the NNX digits CNN trained by 2 processes x 4 devices, each
process handing in its rows of every global batch, its buckets sent from
inside the backward pass (overlap=True), equals the hand-written
post-backward shard_map step bit for bit (and so does a model scanned over
its layers, sent from inside the reverse scan), resumes from a mid-run
orbax checkpoint bit for bit (tests/_builder_worker.py asserts these), and
every process ends with the
same losses and parameters; jc.optax.diloco through jc.data_parallel ends
with the anchor of the same run in one process."""

import os
import pathlib
import sys

import jax
import numpy as np
import pytest
from _builder_worker import diloco_anchor
from helpers import free_port, run_processes, worker_xla_flags

pytestmark = pytest.mark.multiprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_builder_worker.py"


def test_two_processes_of_four_devices(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    num, local = 2, 4
    port = free_port()
    env = {
        **os.environ,
        "XLA_FLAGS": worker_xla_flags(local),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    run_processes(
        [
            [sys.executable, WORKER, port, num, i, local, tmp_path, tmp_path / f"{i}.npz"]
            for i in range(num)
        ],
        [env] * num,
        timeout=300,
        cwd=ROOT,
    )
    results = [np.load(tmp_path / f"{i}.npz") for i in range(num)]
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # it trains
    for r in results[1:]:
        np.testing.assert_array_equal(r["losses"], results[0]["losses"])
        np.testing.assert_array_equal(r["kernel"], results[0]["kernel"])
        np.testing.assert_array_equal(r["anchor"], results[0]["anchor"])
    assert np.abs(results[0]["anchor"]).max() > 0  # two synchronizations moved it
    if len(jax.devices()) >= num * local:
        mesh = jax.make_mesh(
            (num * local,),
            ("data",),
            devices=jax.devices()[: num * local],
            axis_types=(jax.sharding.AxisType.Auto,),
        )
        np.testing.assert_allclose(
            results[0]["anchor"], diloco_anchor(mesh, lambda a: a), rtol=1e-6, atol=1e-7
        )
