"""Serve time: load an engine directory and answer typed questions. Never imports torch.

The public API: everything below, from here. ``Gate`` and ``Cascade`` (confidence gates and cascades), ``Levels``
(a score's levels for ``engine.decide``, which needs pydantic) and ``connect`` (a teacher model over HTTP, which needs
httpx2: the serve extra) are imported on first use, so that ``import onepass`` needs neither extra.
"""

import importlib
from typing import TYPE_CHECKING

from .core.engine import Engine, State
from .core.errors import (BackendUnavailable, EngineFileError, InvalidRequest, LimitExceeded, ModelSourceError,
                          OnepassError)
from .core.questions import Choice, ChoiceAnswer, Noul, NoulAnswer, Score, ScoreAnswer

if TYPE_CHECKING:  # what type checkers see; at run time they load on first use (``__getattr__``)
    from .core.cascade import Cascade, Gate
    from .core.decide import Levels
    from .teacher.client import connect

_ON_FIRST_USE = {"Gate": ".core.cascade", "Cascade": ".core.cascade", "Levels": ".core.decide",
                 "connect": ".teacher.client"}

# what ``from onepass.runtime import *`` takes: not the names loaded on first use, which may need an extra
__all__ = [
    "Engine", "State", "Noul", "Choice", "Score", "NoulAnswer", "ChoiceAnswer", "ScoreAnswer",
    "OnepassError", "InvalidRequest", "LimitExceeded", "EngineFileError", "ModelSourceError", "BackendUnavailable",
]


def __getattr__(name: str):
    if name in _ON_FIRST_USE:
        return getattr(importlib.import_module(_ON_FIRST_USE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list:
    return sorted([*globals(), *_ON_FIRST_USE])
