"""A few steps of a narrow model: for smoke tests."""

import dataclasses

from examples.image_classifier.configs import default


def get_config():
    return dataclasses.replace(
        default.get_config(),
        steps=2,
        log_every=1,
        global_batch_size=16,
        features=(4, 8),
        hidden=16,
    )
