"""One process of the dead-peer test (tests/test_dead_peer.py).

    python tests/_dead_peer_worker.py PORT NUM_PROCESSES PROCESS_ID VICTIM OP HEARTBEAT HOW

Joins a jax.distributed job on loopback (gloo CPU collectives, one CPU
device per process) with ``heartbeat_timeout_seconds=HEARTBEAT`` and runs a
step in a loop: ``OP`` is ``compressed`` (a jitted shard_map step of
``jc.optax.compress_gradients`` with QSGD-4, two-phase, whose collectives
are an all-to-all and an all-gather) or ``psum`` (a plain ``lax.psum`` of
the same gradients). Process VICTIM fails ``KILL_AFTER_S`` after its first
step, from a thread, while its main thread is in the loop (most likely
inside a step), in one of three ways (HOW):

- ``KILL``: SIGKILL, as a crashed or OOM-killed process dies: no Python
  cleanup, no goodbye to the coordinator; the kernel closes its sockets.
- ``STOP``: SIGSTOP, as a frozen host or a cut link looks from outside: the
  sockets stay open, and neither data nor heartbeats come.
- ``SLEEP``: its main thread stops entering steps, but the process lives on
  (a stuck input pipeline): its heartbeats go on.

A survivor that gets an exception from a step reports it and then stays
alive (so that its exit cannot be what fails the others) until the test
kills it. Every process prints one line per event, ``EVENT <name> <unix
time>``, flushed, so that the test reads when the victim failed and when
each survivor stopped, and how. A watchdog ends any process after
``WATCHDOG_S`` whatever happens.
"""

import os
import signal
import sys
import threading
import time

import jax
import numpy as np

KILL_AFTER_S = 0.3  # after the first step; the loop runs steps back to back
WATCHDOG_S = 150
STUCK = threading.Event()
N = 1 << 16


def event(name: str) -> None:
    print(f"EVENT {name} {time.time():.3f}", flush=True)


def watchdog() -> None:
    time.sleep(WATCHDOG_S)
    event("watchdog")
    os._exit(124)


def main(port: int, num: int, pid: int, victim: int, op: str, heartbeat: int, how: str) -> None:
    threading.Thread(target=watchdog, daemon=True).start()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num,
        process_id=pid,
        heartbeat_timeout_seconds=heartbeat,
        # How long a process that exits waits for the others at shutdown.
        shutdown_timeout_seconds=heartbeat,
        initialization_timeout=60,
    )
    import jax.numpy as jnp
    import optax
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp as jc

    mesh = jax.make_mesh((num,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params = {"w": np.zeros(N, np.float32)}
    rows = np.random.default_rng(pid).standard_normal((1, N)).astype(np.float32)
    grads = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), rows)

    if op == "compressed":
        tx = optax.chain(
            jc.optax.compress_gradients(jc.codecs.QSGD(bits=4), "data", algorithm="two_phase"),
            optax.sgd(0.1),
        )
        state = jc.optax.init(tx, params, mesh, "data")
        specs = jc.optax.state_specs(state, "data")

        def body(g, s):
            u, s = tx.update({"w": g[0]}, s)
            return u["w"][None], s

        step = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P("data"), specs),
                out_specs=(P("data"), specs),
                check_vma=False,
            )
        )
    else:

        def body(g, s):
            return lax.psum(g, "data"), s

        step = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()))
        )
        state = jnp.zeros(())

    out, state = step(grads, state)
    out.block_until_ready()
    event("ready")
    if pid == victim:  # dies wherever the loop is then: most likely inside a step

        def die():
            time.sleep(KILL_AFTER_S)
            event("fail")
            if how == "SLEEP":
                STUCK.set()
            else:
                os.kill(os.getpid(), getattr(signal, f"SIG{how}"))

        threading.Thread(target=die, daemon=True).start()
    steps = 0
    try:
        while not STUCK.is_set():
            out, state = step(grads, state)
            out.block_until_ready()
            steps += 1
    except Exception as e:  # what a survivor's training loop would see
        event("error")
        print(f"STEPS {steps}", flush=True)
        print(f"ERROR {type(e).__name__}: {str(e)[:2000]}", flush=True)
    # Stay alive (a survivor that caught the error and has more to do), until
    # killed: by the test, by the watchdog, or by jax.distributed when the
    # coordination service finds a peer's heartbeats missing.
    while True:
        time.sleep(1)


if __name__ == "__main__":
    port, num, pid, victim = (int(a) for a in sys.argv[1:5])
    main(port, num, pid, victim, sys.argv[5], int(sys.argv[6]), sys.argv[7])
