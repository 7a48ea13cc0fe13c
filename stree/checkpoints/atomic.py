"""Files written whole or not at all: each is written to a temporary name beside it and renamed
over the old one (``os.replace`` is atomic on one file system), so an interrupted write never
leaves a truncated checkpoint, state or report behind."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_with(path, write) -> None:
    """``write(tmp_path)`` then rename the temporary file to ``path``. The temporary name is the
    writer's own (process and thread): two writers of one file (the cost cache of two decoding
    processes) must not write into, rename or delete each other's half-written file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path, text: str) -> None:
    write_with(path, lambda tmp: tmp.write_text(text))
