"""Which directories `/update_weights_from_disk` may read: the model's own directory (`--model`)
and every `--weights-dir`, resolved once at startup. A requested path is allowed only when its
real path (symlinks resolved, `..` removed, relative paths taken from the server's working
directory) is one of them or lies below one; anything else is a 403 whose answer does not depend
on whether the path exists, so the route cannot be used to probe the server's file system.
"""

from __future__ import annotations

import os
from pathlib import Path

from tandem.inference.server.args import ServerArgs
from tandem.inference.server.http_api import ApiError


def allowed_weight_dirs(args: ServerArgs) -> list[Path]:
    """The model directory and each `--weights-dir`, as real paths (they need not exist yet)."""
    dirs: list[Path] = []
    for d in (args.model_path, *args.weights_dir):
        real = Path(os.path.realpath(d))
        if real not in dirs:
            dirs.append(real)
    return dirs


def check_weights_path(path: str, allowed: list[Path]) -> None:
    """Raise ApiError 403 unless `path` resolves to one of `allowed` or below one."""
    real = Path(os.path.realpath(path))
    if not any(real.is_relative_to(d) for d in allowed):
        shown = ", ".join(str(d) for d in allowed)
        raise ApiError(f"model_path {path!r} is not inside a directory this server loads weights from ({shown}); "
                       "start the server with --weights-dir DIR to allow another", 403)
