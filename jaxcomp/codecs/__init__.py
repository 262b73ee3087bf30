"""Codecs: frozen, hashable configs with pure ``encode``/``decode``.

One module per codec (``jaxcomp/codecs/<name>.py``); importing this package
imports all of them, and every codec class they register is an attribute of
this package (``jc.codecs.QSGD``, ...). The protocol they follow is in
:mod:`jaxcomp.codecs.base`; every codec passes the contract suite in
tests/test_codec_contract.py.
"""

from jaxcomp.codecs.base import (
    BucketedCodec,
    Codec,
    Kernels,
    Rate,
    SparseCodec,
    VariableRateCodec,
    get,
    import_all,
    names,
    registered,
)

import_all()
globals().update({cls.__name__: cls for cls in registered()})

__all__ = [
    "BucketedCodec",
    "Codec",
    "Kernels",
    "Rate",
    "SparseCodec",
    "VariableRateCodec",
    "get",
    "names",
    "registered",
    *(cls.__name__ for cls in registered()),
]


def __dir__() -> list[str]:
    return sorted(__all__)
