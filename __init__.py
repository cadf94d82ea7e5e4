"""onepass: typed questions about a text, answered in one forward pass of a small decoder.

The public API lives in :mod:`onepass.runtime` and needs no torch::

    from onepass import Engine, Noul, Choice, Score
"""

from .runtime import Choice, Engine, Noul, Score  # noqa: F401

__version__ = "0.1.0"
