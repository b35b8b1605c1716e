"""Where kvloom keeps what it downloads and builds (a base module: stdlib only, so every
layer may import it)."""

from __future__ import annotations

import os
from pathlib import Path


def kvloom_home(home: str | Path | None = None) -> Path:
    """kvloom's cache directory: ``home``, else ``$KVLOOM_HOME``, else ``~/.cache/kvloom``."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("KVLOOM_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvloom"
