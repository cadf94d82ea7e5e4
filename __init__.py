"""onepass: typed questions about a text, answered in one forward pass of a small decoder.

The public API lives in :mod:`onepass.runtime` and needs no torch::

    from onepass import Engine, Noul, Choice, Score
"""

from .runtime import Choice, Engine, Noul, Score  # noqa: F401

try:  # the installed distribution's version: pyproject.toml is its one source
    from importlib.metadata import PackageNotFoundError, version as _version

    __version__ = _version("onepass")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
