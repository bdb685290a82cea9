"""Files written so that a killed writer never leaves a truncated one behind."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write(path, write) -> None:
    """Call write(file) on a temporary file beside `path`, flush it to disk, then rename it
    into place: at worst a stray temporary file is left, never a partial `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; other users' runs read caches
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
