"""Paths a client names on the control plane: a checkpoint to load weights from, a LoRA adapter.

They are read as given: absolute, no ``~`` expansion, never a hub id (a hub download happens only
for what the operator named at launch, and a weight update may name the served ``--model``
itself). With ``--weight-update-dirs`` a path must lie inside one of those folders, links
resolved, and anything else is refused before the file system is asked about it; the worker
answers a path that holds no checkpoint in one wording whatever is there, so no answer tells a
client what exists.
"""

from __future__ import annotations

import os

from minisgl.checkpoint.locate import MAX_PATH_CHARS
from minisgl.config.args import ServerArgs
from minisgl.serve.api.errors import BadRequest


def check_client_path(path: str, args: ServerArgs, field: str, served: str | None = None) -> None:
    """Refuse ``path`` (the body's ``field``) unless a client may name it; ``served``: the one
    non-absolute name also accepted (a weight update back to the served ``--model``)."""
    if served is not None and path == served:
        return
    if not path or "\x00" in path or len(path) > MAX_PATH_CHARS:
        raise BadRequest(f"{field} must be a path of 1 to {MAX_PATH_CHARS} characters without NUL", param=field)
    if not path.startswith("/"):
        raise BadRequest(
            f"{field} must be an absolute path on the server ({path[:200]!r} is not: '~', relative paths "
            "and hub ids are not resolved for clients)",
            param=field,
        )
    if args.weight_update_dirs:
        real, roots = os.path.realpath(path), [os.path.realpath(r) for r in args.weight_update_dirs]
        if not any(os.path.commonpath([real, root]) == root for root in roots):
            raise BadRequest(f"{field} {path[:200]!r} is outside --weight-update-dirs", status=403, param=field)
