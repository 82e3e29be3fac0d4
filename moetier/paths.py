"""Where moetier keeps what it writes once per machine (synthetic models, native kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def moetier_home() -> Path:
    """$MOETIER_HOME, else the user's cache folder (XDG_CACHE_HOME or ~/.cache) / moetier."""
    if os.environ.get("MOETIER_HOME"):
        return Path(os.environ["MOETIER_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moetier"
