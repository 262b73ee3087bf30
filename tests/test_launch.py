"""``python -m jaxcomp launch``: N local processes joined by jax.distributed
over loopback, each line prefixed with its rank; a failing process or
Ctrl-C stops them all, and the exit status is the first failure's."""

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxcomp import launch

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The psum of every device's (process index + 1) over all devices:
# 2 processes x 2 devices give 1 + 1 + 2 + 2 = 6.
PSUM = """
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp as jc

assert jc.launch.initialize()
mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
mine = np.full((jax.local_device_count(),), jax.process_index() + 1.0, np.float32)
x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), mine)
total = jax.jit(
    jax.shard_map(lambda a: jax.lax.psum(a, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
)(x)
want = sum(
    (d.process_index + 1.0) for d in jax.devices()
)
assert float(total[0]) == want, (float(total[0]), want)
print(f"process {jax.process_index()} of {jax.process_count()}: "
      f"{jax.local_device_count()} of {jax.device_count()} devices, psum {float(total[0])}")
"""

# Process 1 fails at once; process 0 ignores SIGTERM and would sleep for
# minutes: only the launcher's SIGKILL after the grace period ends it.
FAILING = """
import os, signal, sys, time
rank = int(os.environ["JAXCOMP_PROCESS_ID"])
print(f"pid {os.getpid()}", flush=True)
if rank == 1:
    time.sleep(0.5)
    sys.exit(4)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(300)
"""

# Both processes wait until interrupted, and say so.
# "ready" is printed inside the try: the test's SIGINT may arrive while the
# print is still returning, after its line reached the launcher.
INTERRUPTIBLE = """
import sys, time
try:
    print("ready", flush=True)
    time.sleep(300)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(1)
"""


def _launcher(*args) -> list[str]:
    return [sys.executable, "-m", "jaxcomp", "launch", *map(str, args)]


def _env() -> dict[str, str]:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _script(tmp_path, text: str):
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(text))
    return path


def test_resolve_command_runs_scripts_and_python_with_this_python():
    assert launch.resolve_command(["train.py", "-x"]) == [sys.executable, "train.py", "-x"]
    assert launch.resolve_command(["python", "-m", "m"]) == [sys.executable, "-m", "m"]
    assert launch.resolve_command(["python3.12", "a.py"]) == [sys.executable, "a.py"]
    assert launch.resolve_command(["./run.sh", "a"]) == ["./run.sh", "a"]
    with pytest.raises(ValueError, match="no command"):
        launch.resolve_command([])


def test_process_env_replaces_the_device_count_and_keeps_other_flags():
    base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1", "A": "b"}
    env = launch.process_env(1, 3, "127.0.0.1:1234", 2, base)
    assert env["XLA_FLAGS"].split() == ["--xla_foo=1", "--xla_force_host_platform_device_count=2"]
    assert env[launch.COORDINATOR] == "127.0.0.1:1234"
    assert (env[launch.NUM_PROCESSES], env[launch.PROCESS_ID]) == ("3", "1")
    assert env[launch.LOCAL_DEVICE_IDS] == "2,3"  # process 1's GPUs, 2 per process
    assert env["A"] == "b" and "PYTHONUNBUFFERED" in env


def test_initialize_outside_a_launch_does_nothing_and_rejects_half_an_environment(monkeypatch):
    monkeypatch.delenv(launch.COORDINATOR, raising=False)
    assert launch.initialize() is False
    monkeypatch.setenv(launch.COORDINATOR, "127.0.0.1:1")
    monkeypatch.delenv(launch.NUM_PROCESSES, raising=False)
    with pytest.raises(RuntimeError, match="python -m jaxcomp launch"):
        launch.initialize()


@pytest.mark.multiprocess
def test_two_processes_psum_across_each_other(tmp_path):
    script = _script(tmp_path, PSUM)
    r = subprocess.run(
        _launcher("-n", 2, "--devices-per-process", 2, "--", "python", script),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for rank in range(2):
        assert f"[{rank}] process {rank} of 2: 2 of 4 devices, psum 6.0" in lines, r.stdout


@pytest.mark.multiprocess
def test_a_failing_process_stops_the_others(tmp_path):
    script = _script(tmp_path, FAILING)
    t0 = time.monotonic()
    r = subprocess.run(
        _launcher("-n", 2, "--grace", 1, "--", script),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 4, r.stdout + r.stderr  # process 1's status
    assert time.monotonic() - t0 < 60  # not process 0's 300 s
    assert "process 1 exited with status 4; stopping the others" in r.stderr
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("[0] pid ")]
    with pytest.raises(ProcessLookupError):  # killed, and reaped by the launcher
        os.kill(int(line.split()[-1]), 0)


@pytest.mark.multiprocess
def test_ctrl_c_reaches_every_process(tmp_path):
    script = _script(tmp_path, INTERRUPTIBLE)
    p = subprocess.Popen(
        _launcher("-n", 2, "--", script),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in p.stdout:  # wait until both have started
        seen.append(line)
        if sum("ready" in s for s in seen) == 2:
            break
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    out = "".join(seen) + out
    assert p.returncode == 128 + signal.SIGINT, out + err
    assert "[0] interrupted" in out and "[1] interrupted" in out, out + err


@pytest.mark.multiprocess
def test_the_teacher_example_trains_on_two_processes():
    """The command of docs/training-loop.md, on the tiny config: both
    processes end with the same (replicated) model and metrics."""
    pytest.importorskip("flax")
    example = ["python", "-m", "examples.teacher.main", "--config"]
    example += ["examples/teacher/configs/tiny.py", "--codec", "qsgd:bits=4", "--quiet"]
    r = subprocess.run(
        _launcher("-n", 2, "--", *example),
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    finals = {ln[:4]: ln[4:] for ln in r.stdout.splitlines() if ln[4:].startswith("final:")}
    assert set(finals) == {"[0] ", "[1] "}, r.stdout
    assert finals["[0] "] == finals["[1] "]
