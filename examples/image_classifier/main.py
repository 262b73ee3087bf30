"""Trains the digits CNN with a compressed gradient all-reduce.

    python -m examples.image_classifier.main --codec qsgd:bits=4 --steps 600
    python -m examples.image_classifier.main --codec float32 --workdir /tmp/digits

Run from the repository root. ``--config`` names a Python file whose
``get_config()`` returns a ``train.Config`` (default: configs/default.py);
the other flags override its fields.
"""

from __future__ import annotations

from examples import common

common.simulate_devices(8)  # before jax is imported (by train below)

import argparse  # noqa: E402

from examples.image_classifier import train  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m examples.image_classifier.main",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_flags(ap)
    args = ap.parse_args(argv)
    config = common.config_from_flags(args, default="examples/image_classifier/configs/default.py")
    result = train.train_and_evaluate(config, args.workdir, verbose=not args.quiet)
    print(
        f"final: test accuracy {result['test_accuracy']:.4f}  test loss {result['test_loss']:.4f}  "
        f"bits/element {result['bits_per_element']:.3f}  wire bytes/step {result['wire_bytes']:,.0f}"
    )
    return result


if __name__ == "__main__":
    main()
