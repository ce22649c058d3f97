"""The tarfile filter every archive we hand to the Docker daemon goes through (`put_archive`).

Files copied into a sandbox must not carry the host user's ids: inside the container they would belong to
whatever account has that uid. `RootOwned` makes every entry root's and counts the bytes added, so a caller
can stop an archive that grows past its limit before it is sent.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable


class RootOwned:
    """`tar.add(..., filter=RootOwned(...))`: each entry root-owned; `total` bytes of file data so far.

    With `limit`, the entry that takes `total` past it raises `too_large()` (nothing partial is sent: the
    caller's archive is still in memory).
    """

    def __init__(self, limit: int | None = None, too_large: Callable[[], Exception] | None = None) -> None:
        if limit is not None and too_large is None:
            raise ValueError("RootOwned: a limit needs a too_large factory for the error it raises")
        self.limit, self.too_large, self.total = limit, too_large, 0

    def __call__(self, info: tarfile.TarInfo) -> tarfile.TarInfo:
        self.total += info.size
        if self.limit is not None and self.total > self.limit:
            raise self.too_large()  # type: ignore[misc]
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info
