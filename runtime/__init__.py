"""Serve time: load an engine directory and answer typed questions. Never imports torch."""

from .engine import Engine, State
from .errors import BackendUnavailable, EngineFileError, InvalidRequest, LimitExceeded, ModelSourceError, OnepassError
from .questions import Choice, ChoiceAnswer, Noul, NoulAnswer, Score, ScoreAnswer

__all__ = [
    "Engine", "State", "Noul", "Choice", "Score", "NoulAnswer", "ChoiceAnswer", "ScoreAnswer",
    "OnepassError", "InvalidRequest", "LimitExceeded", "EngineFileError", "ModelSourceError", "BackendUnavailable",
]
