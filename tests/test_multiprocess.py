"""jc.psum across separate processes (jax.distributed on loopback, gloo CPU
collectives) gives the same bytes as the same computation in one process,
value, sent and the new server residual alike (for linear codecs, whose
payloads are summed by the backend's all-reduce, the same sum up to its
order); and jc.optax.onebit_adam's updates across the freeze are the
same on every process and equal to one process's up to that order, and
so are jc.optax.powersgd's."""

import os
import pathlib
import sys

import jax
import numpy as np
import pytest

import jaxcomp as jc

pytestmark = pytest.mark.multiprocess

WORKER = pathlib.Path(__file__).with_name("_mp_worker.py")
sys.path.insert(0, str(WORKER.parent))
import _mp_worker  # noqa: E402
from helpers import free_port, run_processes, worker_xla_flags  # noqa: E402


# Four processes (two would leave ring and two-phase a single hop each); the
# two-process case is test_end_to_end_smoke's and test_train_builder_multiprocess's.
@pytest.mark.parametrize("num", [4])
def test_psum_across_processes_matches_one_process(tmp_path, num):
    if len(jax.devices()) < num:
        pytest.skip(f"the single-process reference needs {num} devices")
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": worker_xla_flags(), "JAX_PLATFORMS": "cpu"}
    run_processes(
        [[sys.executable, WORKER, port, num, i, tmp_path / f"{i}.npz"] for i in range(num)],
        [env] * num,
        timeout=240,
    )

    mesh = jax.make_mesh(
        (num,), ("data",), devices=jax.devices()[:num], axis_types=(jax.sharding.AxisType.Auto,)
    )
    x = _mp_worker.global_input(num)
    results = [np.load(tmp_path / f"{i}.npz") for i in range(num)]
    for c, (name, params, algorithm) in enumerate(_mp_worker.CASES):
        codec = jc.codecs.get(name, **params)
        state = _mp_worker.global_state(codec, algorithm, num)
        value, sent, new_state = _mp_worker.run(mesh, x, codec, algorithm, state)
        for i, got in enumerate(results):
            what = f"{name} {algorithm} process {i}"
            np.testing.assert_array_equal(
                got[f"sent{c}"], np.asarray(sent)[i : i + 1], err_msg=what
            )
            if new_state.size:  # an algorithm with a second compression
                np.testing.assert_array_equal(
                    got[f"state{c}"], np.asarray(new_state)[i : i + 1], err_msg=what
                )
            if codec.rate is jc.codecs.Rate.LINEAR:
                # One psum of the payloads: the sum's order is the backend's
                # (gloo's ring here), the same on every process.
                np.testing.assert_array_equal(got[f"value{c}"], results[0][f"value{c}"])
                np.testing.assert_allclose(
                    got[f"value{c}"], np.asarray(value)[i : i + 1], rtol=1e-5, err_msg=what
                )
            else:  # every device decodes the same payloads, adds in the same order
                np.testing.assert_array_equal(
                    got[f"value{c}"], np.asarray(value)[i : i + 1], err_msg=what
                )
    # onebit_adam: the same updates on every process; one process's up to
    # the order of the warm-up's exact all-reduce (gloo's ring here)
    want = np.asarray(_mp_worker.adam_updates(mesh, x))
    for i, got in enumerate(results):
        np.testing.assert_array_equal(got["adam"], results[0]["adam"], err_msg=f"process {i}")
        np.testing.assert_allclose(got["adam"][0], want[i], rtol=1e-3, atol=1e-8)
    # powersgd: its factors' all-reduces likewise
    want = np.asarray(_mp_worker.powersgd_updates(mesh, x))
    for i, got in enumerate(results):
        np.testing.assert_array_equal(got["powersgd"], results[0]["powersgd"], err_msg=str(i))
        np.testing.assert_allclose(got["powersgd"][0], want[i], rtol=1e-4, atol=1e-5)
