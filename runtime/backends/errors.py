"""The errors the backends raise, and the root of every onepass error.

The dependency runs one way, core -> backends: the backends own what they raise (an engine file they cannot read, a
model they cannot build, an optional package not installed), and ``core.errors`` builds the request-side errors on
the same root. The root lives here, in the lowest layer, so that every layer can subclass it.
"""

from __future__ import annotations


class OnepassError(Exception):
    """Base of every error onepass raises on purpose."""


class EngineFileError(OnepassError):
    """An engine directory is missing, incomplete, tampered with or of an unknown version."""


class ModelSourceError(OnepassError):
    """A model to export cannot be found or is of an unsupported kind."""


class BackendUnavailable(OnepassError, ImportError):
    """An optional backend's package is not installed; the message names the package."""
