"""Serve time: load an engine directory and answer typed questions. Never imports torch."""

from .core.engine import Engine, State
from .core.errors import (BackendUnavailable, EngineFileError, InvalidRequest, LimitExceeded, ModelSourceError,
                          OnepassError)
from .core.questions import Choice, ChoiceAnswer, Noul, NoulAnswer, Score, ScoreAnswer

__all__ = [
    "Engine", "State", "Noul", "Choice", "Score", "NoulAnswer", "ChoiceAnswer", "ScoreAnswer",
    "OnepassError", "InvalidRequest", "LimitExceeded", "EngineFileError", "ModelSourceError", "BackendUnavailable",
]
