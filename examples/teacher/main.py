"""Trains the student MLP on the teacher's labels with a compressed gradient
all-reduce.

    python -m examples.teacher.main --codec qsgd:bits=4 --steps 2000
    python -m examples.teacher.main --codec onebit --algorithm allgather
    python -m examples.teacher.main --codec float32 --workdir /tmp/teacher

Run from the repository root. ``--config`` names a Python file whose
``get_config()`` returns a ``train.Config`` (default: configs/default.py);
the other flags override its fields.
"""

from __future__ import annotations

from examples import common

common.simulate_devices(8)  # before jax is imported (by train below)

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import jaxcomp as jc  # noqa: E402
from examples.teacher import train  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m examples.teacher.main",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_flags(ap)
    ap.add_argument(
        "--server-error-feedback",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="two-phase all-reduce: keep the second compression's error in a server "
        "residual (two-level error feedback, the default); off: charge it to the chunk "
        "owner's residual (one-level)",
    )
    args = ap.parse_args(argv)
    config = common.config_from_flags(args, default="examples/teacher/configs/default.py")
    if args.server_error_feedback is not None:
        config = dataclasses.replace(config, server_error_feedback=args.server_error_feedback)
    jc.launch.initialize()  # under `python -m jaxcomp launch`: join the other processes
    result = train.train_and_evaluate(config, args.workdir, verbose=not args.quiet)
    print(
        f"final: test accuracy {result['test_accuracy']:.4f}  held-out loss "
        f"{result['test_loss']:.4f}  bits/element {result['bits_per_element']:.3f}  "
        f"wire bytes/step {result['wire_bytes']:,.0f}"
    )
    return result


if __name__ == "__main__":
    main()
