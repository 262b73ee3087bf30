"""Codecs: frozen, hashable configs with pure ``encode``/``decode``.

Every codec passes the contract suite in tests/test_codec_contract.py.
"""

from jaxcomp.codecs.base import Codec, get, names
from jaxcomp.codecs.cast import Cast
from jaxcomp.codecs.identity import Identity
from jaxcomp.codecs.int8 import Int8
from jaxcomp.codecs.natural import Natural
from jaxcomp.codecs.onebit import OneBit
from jaxcomp.codecs.qsgd import QSGD
from jaxcomp.codecs.terngrad import TernGrad
from jaxcomp.codecs.threelc import ThreeLC
from jaxcomp.codecs.topk import TopK

__all__ = [
    "QSGD",
    "Cast",
    "Codec",
    "Identity",
    "Int8",
    "Natural",
    "OneBit",
    "TernGrad",
    "ThreeLC",
    "TopK",
    "get",
    "names",
]
