"""Where onepass keeps what it derives once and reuses: converted models, TensorRT timing caches."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$ONEPASS_CACHE or ~/.cache/onepass."""
    return Path(os.environ.get("ONEPASS_CACHE", Path.home() / ".cache" / "onepass"))
