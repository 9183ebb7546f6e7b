"""The data directory is private to the user runcap runs as: 0700, and everything runcap creates
in it 0600 / 0700 — the payload store (every prompt and answer), the ledger (`ledger.sqlite3` and
SQLite's `-wal` / `-shm`), the chdb store, the WAL, the shipper's socket, the admin token.

One mechanism rather than a `chmod` after each writer: the process's umask is 0077 from start-up
on, so SQLite, chdb, the payload store and the shipper (a child process: it inherits the umask)
create private files without knowing it; and the directory itself is 0700, so what an older
version left group/world-readable inside is not reachable either.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("runcap.server")

PRIVATE_UMASK = 0o077


def make_private(data_dir: Path) -> None:
    """Create `data_dir` (0700) or tighten it to 0700 when this user owns it, and set the umask
    every later file is created with."""
    os.umask(PRIVATE_UMASK)
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = data_dir.stat()
    if stat.S_IMODE(st.st_mode) & 0o077 == 0:
        return
    if st.st_uid != os.getuid() or st.st_mode & stat.S_ISVTX:
        # Not ours (or a shared sticky directory like /tmp): say so rather than change it.
        log.warning(
            '{"event": "data_dir_not_private", "data_dir": "%s", "mode": "%o", "hint": "use a directory '
            'of your own (chmod 700) for data_dir: payloads and the ledger are readable by others"}',
            data_dir, stat.S_IMODE(st.st_mode),
        )  # fmt: skip
        return
    os.chmod(data_dir, 0o700)
