"""Several JAX processes on one machine, joined over loopback.

    python -m jaxcomp launch -n 2 -- python train.py --steps 20
    python -m jaxcomp launch -n 2 --devices-per-process 4 -- train.py --steps 20
    python -m jaxcomp launch -n 2 -- python -m examples.teacher.main --steps 20

:func:`run` starts ``N`` copies of a command, tells each its rank and the
coordinator (127.0.0.1 and a free port) through environment variables,
prefixes every line each writes with ``[rank]``, and tears them down
together: when one exits with an error, the others get SIGTERM (and SIGKILL
after a grace period); SIGINT (Ctrl-C) and SIGTERM sent to the launcher go
to every process. Its exit status is the first failure's.

Each process calls :func:`initialize` before its first JAX computation; it
runs ``jax.distributed.initialize`` from those variables, and does nothing
in a process that was not launched, so a script runs alone or launched
alike. On the CPU each process gets ``devices_per_process`` simulated
devices (``XLA_FLAGS=--xla_force_host_platform_device_count``); on GPUs,
process ``i`` gets the GPUs ``i*K`` to ``i*K + K - 1``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

# What the launcher tells each process (read by `initialize`).
COORDINATOR = "JAXCOMP_COORDINATOR"  # "127.0.0.1:PORT", the same for every process
NUM_PROCESSES = "JAXCOMP_NUM_PROCESSES"
PROCESS_ID = "JAXCOMP_PROCESS_ID"  # 0 .. NUM_PROCESSES - 1
LOCAL_DEVICE_IDS = "JAXCOMP_LOCAL_DEVICE_IDS"  # "0,1": this process's GPUs

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def initialize() -> bool:
    """Joins the job of ``python -m jaxcomp launch``, if this process is in one.

    Call it before the first JAX computation (``jax.devices()`` included),
    as ``jax.distributed.initialize`` requires. In a process the launcher
    started, it calls ``jax.distributed.initialize`` with the coordinator,
    the number of processes, this process's id and its GPUs from the
    environment (``JAXCOMP_COORDINATOR``, ``JAXCOMP_NUM_PROCESSES``,
    ``JAXCOMP_PROCESS_ID``, ``JAXCOMP_LOCAL_DEVICE_IDS``); elsewhere, and
    when ``jax.distributed`` is already initialized, it does nothing.

    Returns:
      True if this process is one of a launched job.
    Raises:
      RuntimeError: the launcher's variables are incomplete or malformed
        (set by hand?), or JAX's backends have already started.
    """
    env = os.environ
    if COORDINATOR not in env:
        return False
    import jax

    if jax.distributed.is_initialized():
        return True
    try:
        num = int(env[NUM_PROCESSES])
        pid = int(env[PROCESS_ID])
        ids = [int(i) for i in env.get(LOCAL_DEVICE_IDS, "").split(",") if i.strip()]
    except (KeyError, ValueError) as e:
        raise RuntimeError(
            f"jaxcomp.launch.initialize: {COORDINATOR} is set but {NUM_PROCESSES}, "
            f"{PROCESS_ID} or {LOCAL_DEVICE_IDS} is missing or not an integer ({e!r}); "
            "start the processes with `python -m jaxcomp launch -n N -- ...`, or unset "
            f"{COORDINATOR} to run one process alone"
        ) from None
    jax.distributed.initialize(
        coordinator_address=env[COORDINATOR],
        num_processes=num,
        process_id=pid,
        local_device_ids=ids or None,
    )
    return True


def resolve_command(command: Sequence[str]) -> list[str]:
    """The argv that runs ``command``: a ``*.py`` script with this Python,
    ``python`` (``python3``, ``python3.12``) replaced by this Python (the
    one the launcher runs in, with its packages), anything else as given."""
    if not command:
        raise ValueError("jaxcomp launch: no command given (`-- python train.py ARGS`)")
    first, rest = command[0], list(command[1:])
    if first.endswith(".py"):
        return [sys.executable, first, *rest]
    if re.fullmatch(r"python(\d+(\.\d+)?)?", first):
        return [sys.executable, *rest]
    return [first, *rest]


def process_env(
    rank: int,
    num_processes: int,
    coordinator: str,
    devices_per_process: int,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process ``rank``: ``base`` (this process's
    environment) with the launcher's variables, ``devices_per_process``
    simulated CPU devices in ``XLA_FLAGS`` (replacing a count already
    there), and unbuffered Python output (lines arrive as written)."""
    env = dict(os.environ if base is None else base)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    flags.append(f"{_DEVICE_COUNT_FLAG}={devices_per_process}")
    k = devices_per_process
    env.update(
        {
            COORDINATOR: coordinator,
            NUM_PROCESSES: str(num_processes),
            PROCESS_ID: str(rank),
            LOCAL_DEVICE_IDS: ",".join(str(i) for i in range(rank * k, (rank + 1) * k)),
            "XLA_FLAGS": " ".join(flags),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_status(returncode: int) -> int:
    """A shell's status for a child's return code (128 + n if signal n ended it)."""
    return 128 - returncode if returncode < 0 else returncode


def _pump(stream: BinaryIO, out: BinaryIO, prefix: bytes, lock: threading.Lock) -> None:
    """Copies ``stream`` to ``out`` line by line, each line after ``prefix``.
    Of a line a progress bar redrew with carriage returns, the last drawing."""
    for raw in iter(stream.readline, b""):
        line = raw.rstrip(b"\r\n").rsplit(b"\r", 1)[-1]
        with lock:
            out.write(prefix + line + b"\n")
            out.flush()
    stream.close()


class _Job:
    """The launched processes, their output threads and their teardown."""

    def __init__(self, stdout: BinaryIO, stderr: BinaryIO, grace: float):
        self.stdout, self.stderr = stdout, stderr
        self.grace = grace
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.deadline: float | None = None  # SIGKILL whatever runs after it

    def start(self, argv: list[str], envs: list[dict[str, str]]) -> None:
        """Starts one process per environment, its output pumped by two threads."""
        width = len(str(len(envs) - 1))
        for rank, env in enumerate(envs):
            # A session of its own: the terminal's Ctrl-C reaches the launcher
            # alone, which forwards it once to each process's group.
            p = subprocess.Popen(
                argv,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            self.procs.append(p)
            prefix = f"[{rank:>{width}}] ".encode()
            for stream, out in ((p.stdout, self.stdout), (p.stderr, self.stderr)):
                t = threading.Thread(
                    target=_pump, args=(stream, out, prefix, self.lock), daemon=True
                )
                t.start()
                self.threads.append(t)

    def note(self, text: str) -> None:
        """A line of the launcher's own on stderr."""
        with self.lock:
            self.stderr.write(f"jaxcomp launch: {text}\n".encode())
            self.stderr.flush()

    def signal_all(self, sig: int) -> None:
        """Sends ``sig`` to the process group of every process (what a
        process started, such as a shell script's Python, goes with it)."""
        for p in self.procs:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):  # the group has ended
                pass

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Sends ``sig`` to every running process; SIGKILL after the grace period."""
        self.signal_all(sig)
        if self.deadline is None:
            self.deadline = time.monotonic() + self.grace

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def close(self) -> None:
        """Kills what is left and waits for the processes and their output."""
        self.signal_all(signal.SIGKILL)
        for p in self.procs:
            p.wait()
        for t in self.threads:
            t.join()


def run(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int = 1,
    grace_seconds: float = 5.0,
    stdout: BinaryIO | None = None,
    stderr: BinaryIO | None = None,
) -> int:
    """Runs ``command`` as ``num_processes`` processes joined over loopback.

    Args:
      command: the argv of every process (see :func:`resolve_command`); it
        calls :func:`initialize` before its first JAX computation.
      num_processes: how many processes (>= 1).
      devices_per_process: simulated CPU devices of each process, or GPUs
        given to each on a GPU machine.
      grace_seconds: how long the processes have to exit after SIGTERM or a
        forwarded SIGINT before they are killed.
      stdout, stderr: where the processes' prefixed lines go (binary
        streams; this process's by default).
    Returns:
      0 if every process succeeded, else the first failure's exit status
      (128 + n for a process ended by signal n; 128 + n also when the
      launcher got signal n, SIGINT or SIGTERM, before any failure).
    """
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(
            f"jaxcomp launch: -n ({num_processes}) and --devices-per-process "
            f"({devices_per_process}) must be at least 1"
        )
    argv = resolve_command(command)
    coordinator = f"127.0.0.1:{free_port()}"
    envs = [
        process_env(r, num_processes, coordinator, devices_per_process)
        for r in range(num_processes)
    ]
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr.buffer
    received: list[int] = []

    def on_signal(sig, frame):
        del frame
        received.append(sig)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    if main_thread:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    status = 0
    job = _Job(stdout, stderr, grace_seconds)
    try:
        job.start(argv, envs)
        handled = 0
        while job.running():
            while handled < len(received):  # forward each signal; a second one kills
                sig = received[handled]
                handled += 1
                status = status or 128 + sig
                job.stop(sig if handled == 1 else signal.SIGKILL)
            for rank, p in enumerate(job.procs):
                code = p.poll()
                if code and not status:
                    status = _exit_status(code)
                    job.note(f"process {rank} exited with status {status}; stopping the others")
                    job.stop()
            if job.deadline is not None and time.monotonic() > job.deadline:
                job.signal_all(signal.SIGKILL)
            time.sleep(0.02)
        if not status:  # the last ones may have failed together
            codes = [p.returncode for p in job.procs]
            status = next((_exit_status(c) for c in codes if c), 0)
    finally:  # also after a process that could not start: the others go
        job.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status
