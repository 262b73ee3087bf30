"""Sharded training across processes (jax.distributed on loopback, gloo CPU
collectives): 2 processes x 4 devices give the residuals of the same
steps on 8 devices of one process bit for bit (the compressed
reduce-scatter sums in device order whichever way its all-to-all travels),
and the parameters and losses to rounding."""

import os
import pathlib
import sys

import jax
import numpy as np
import pytest
from _fsdp_worker import train
from helpers import free_port, run_processes, worker_env

pytestmark = pytest.mark.multiprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_fsdp_worker.py"


def test_two_processes_equal_one():
    num, local = 2, 4
    port = free_port()
    env = worker_env(ROOT, local)
    tmp = pathlib.Path(os.environ.get("TMPDIR", "/tmp"))
    outs = [tmp / f"fsdp-{port}-{i}.npz" for i in range(num)]
    run_processes(
        [[sys.executable, WORKER, port, num, i, local, outs[i]] for i in range(num)],
        [env] * num,
        timeout=300,
        cwd=ROOT,
    )
    results = [dict(np.load(o)) for o in outs]
    for o in outs:
        o.unlink()
    assert results[0]["losses"][-1] < results[0]["losses"][0]  # it trains
    mesh = jax.make_mesh((num * local,), ("fsdp",), devices=jax.devices()[: num * local])
    one = train(mesh, lambda a: a)
    for r in results:
        assert r.keys() == one.keys()
        # The loss is averaged by a float32 all-reduce, whose order of
        # addition is the backend's: equal to rounding.
        np.testing.assert_allclose(r.pop("losses"), one["losses"], rtol=1e-6)
        # The residuals bit for bit. tx's update runs on global arrays that
        # XLA partitions, and it may fuse the update of a one-process and a
        # multi-process program differently: the parameters to float32
        # rounding (a few ulps of their largest magnitude over the steps).
        for k in r:
            if k.startswith("r"):
                np.testing.assert_array_equal(r[k], one[k], err_msg=k)
            else:
                tol = 8 * np.finfo(np.float32).eps * np.abs(one[k]).max()
                np.testing.assert_allclose(r[k], one[k], rtol=0, atol=tol, err_msg=k)
