"""A peer that dies during repeated compressed all-reduces (jax.distributed on
loopback, gloo CPU collectives): the other processes end, with an error,
within a bounded time, instead of hanging.

- Killed (SIGKILL: its sockets are closed by the kernel): every survivor's
  next collective raises ``JaxRuntimeError`` from gloo ("Connection reset
  by peer" / "Connection closed by peer") within a fraction of a second.
- Frozen (SIGSTOP: sockets open, no data, no heartbeats): the survivors'
  collectives wait (gloo has no timeout of its own here), and what ends
  them is jax.distributed's heartbeat: once the coordination service has
  missed the peer's heartbeats for ``heartbeat_timeout_seconds``, every
  process is terminated (abort). That is the knob that bounds the hang.

Every process runs under a watchdog (tests/_dead_peer_worker.py) and is
killed by the test when it is done, whatever happened."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import free_port, worker_xla_flags

pytestmark = pytest.mark.multiprocess

WORKER = pathlib.Path(__file__).with_name("_dead_peer_worker.py")
START_S = 120  # to start, join the job and compile, on a loaded machine
KILLED_BOUND_S = 10.0  # measured: 0.04-0.15 s
HEARTBEAT_S = 4
HEARTBEAT_MARGIN_S = 10.0  # the service's check period, the abort, the load


def _events(path: pathlib.Path) -> dict[str, float]:
    text = path.read_text(errors="replace") if path.exists() else ""
    return {m[1]: float(m[2]) for m in re.finditer(r"^EVENT (\w+) ([\d.]+)$", text, re.M)}


def _run_job(tmp_path, num, victim, how, heartbeat, until, limit_s):
    """Starts ``num`` workers, waits until ``until(procs, logs)`` holds or
    ``limit_s`` passes, then kills every worker still alive. Returns the
    logs' paths and the processes."""
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": worker_xla_flags(), "JAX_PLATFORMS": "cpu"}
    logs = [tmp_path / f"{i}.log" for i in range(num)]
    procs = []
    try:
        for i in range(num):
            with open(logs[i], "w") as out:
                args = [str(a) for a in (port, num, i, victim, "compressed", heartbeat, how)]
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(WORKER), *args],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and not until(procs, logs):
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)  # also ends a stopped process
        for p in procs:
            p.wait(timeout=30)
    return logs, procs


def _tail(path) -> str:
    return path.read_text(errors="replace")[-3000:]


def _watch_survivors(victim, survivors, exited):
    """A ``until`` for :func:`_run_job`: done when every survivor has
    reported an error or exited (``exited`` gets each exit's time)."""

    def done(procs, logs):
        if "fail" not in _events(logs[victim]):
            return any(p.poll() is not None for p in procs)  # a start-up failure
        for i in survivors:
            if i not in exited and procs[i].poll() is not None:
                exited[i] = time.time()  # within the 0.2 s poll; one machine, one clock
        return all(i in exited or "error" in _events(logs[i]) for i in survivors)

    return done


@pytest.mark.parametrize("num, victim", [(2, 1), (4, 0)], ids=["2-processes", "4-coordinator"])
def test_a_killed_peer_ends_the_others_with_an_error(tmp_path, num, victim):
    """A killed worker: its peers' collectives raise at once. A killed
    coordinator (process 0, which hosts jax.distributed's service): each
    peer either raises from gloo or is terminated by its distributed
    client, which lost the service, whichever comes first; both at once."""
    survivors = [i for i in range(num) if i != victim]
    exited = {}
    logs, procs = _run_job(
        tmp_path, num, victim, "KILL", 30, _watch_survivors(victim, survivors, exited), START_S
    )
    ev = [_events(p) for p in logs]
    assert "fail" in ev[victim], f"the victim never got to fail:\n{_tail(logs[victim])}"
    for i in survivors:
        text = logs[i].read_text(errors="replace")
        raised = re.search(r"^ERROR JaxRuntimeError: .*[Gg]loo", text, re.M)
        if raised:
            ended = ev[i]["error"]
        else:
            assert victim == 0 and i in exited, f"process {i} did not raise:\n{_tail(logs[i])}"
            assert procs[i].returncode == -signal.SIGABRT, _tail(logs[i])
            assert "detected fatal errors" in text, _tail(logs[i])
            ended = exited[i]
        took = ended - ev[victim]["fail"]
        print(f"process {i} ended {took:.2f} s after the kill")
        assert took < KILLED_BOUND_S, f"process {i} took {took:.2f} s"


@pytest.mark.slow
def test_a_frozen_peer_is_ended_by_the_heartbeat_timeout(tmp_path):
    """A frozen worker: its peers wait inside the collective until
    jax.distributed has missed its heartbeats for heartbeat_timeout_seconds,
    then every one of them is terminated."""
    num, victim = 2, 1
    survivors = [i for i in range(num) if i != victim]
    exited = {}

    def done(procs, logs):
        started_up = _watch_survivors(victim, survivors, exited)(procs, logs)  # records exits
        if "fail" not in _events(logs[victim]):
            return started_up  # True: a start-up failure
        return len(exited) == len(survivors)

    logs, procs = _run_job(tmp_path, num, victim, "STOP", HEARTBEAT_S, done, START_S)
    ev = [_events(p) for p in logs]
    assert "fail" in ev[victim], f"the victim never got to fail:\n{_tail(logs[victim])}"
    for i in survivors:
        text = logs[i].read_text(errors="replace")
        # Ended by jax.distributed (an abort), not by the test's kill or the
        # watchdog, within the heartbeat timeout and a margin.
        assert i in exited, f"process {i} was still running:\n{_tail(logs[i])}"
        assert procs[i].returncode == -signal.SIGABRT, f"process {i}:\n{_tail(logs[i])}"
        assert "detected fatal errors" in text, _tail(logs[i])
        took = exited[i] - ev[victim]["fail"]
        print(f"process {i} ended {took:.2f} s after the stop")
        assert took < HEARTBEAT_S + HEARTBEAT_MARGIN_S, f"process {i} took {took:.1f} s"
