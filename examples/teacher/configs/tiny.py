"""A few steps of a narrow model on a small held-out set: for smoke tests."""

import dataclasses

from examples.teacher.configs import default


def get_config():
    return dataclasses.replace(
        default.get_config(),
        steps=4,
        log_every=2,
        global_batch_size=64,
        hidden=(64, 32),  # kernels of 1024 and 2048 values: compressed
        test_size=4096,
    )
