"""The agent's private runtime directory, and the checks that keep its local paths from
being squatted.

Names in world-writable places (``/tmp``, ``/dev/shm``) can be created by any local user
before the agent starts: a socket path clients would connect to, a directory chunks would
be written to and read from. So the defaults live in a per-user directory made 0700
(``default_runtime_dir``), which the agent checks is its own before using it.

The directory is ``/tmp/tiered-cache-<euid>``, not ``$XDG_RUNTIME_DIR`` or ``$TMPDIR``:
the agent (often a service) and vLLM (often a login shell) must compute the same default
socket path, and those variables differ between the two. ``TIERED_CACHE_RUNTIME_DIR``
names another (a volume the agent's and vLLM's containers share); it is checked the same
way, and every process that uses the defaults must see the same value.
"""

from __future__ import annotations

import os
import stat


class UnsafePath(ValueError):
    """A local path the agent would use belongs to another user or is open to others.
    (A ValueError: the CLI shows it as one line.)"""


RUNTIME_DIR_ENV = "TIERED_CACHE_RUNTIME_DIR"


def default_runtime_dir() -> str:
    """Where the default socket and NVMe directory live: private to this user."""
    return os.environ.get(RUNTIME_DIR_ENV) or f"/tmp/tiered-cache-{os.geteuid()}"


def ensure_private_dir(path: str) -> None:
    """Create ``path`` mode 0700 if absent; otherwise require that it is a directory (not
    a symlink), owned by us, and closed to group and others. UnsafePath if not: another
    user may have made it to read our chunks or to answer in our socket's place."""
    try:
        os.mkdir(path, 0o700)  # the umask can only narrow it
    except FileExistsError:
        pass
    except OSError as e:
        raise UnsafePath(f"cannot create the runtime directory {path}: {e}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"runtime directory {path} is not a directory (or is a symlink)")
    refuse_foreign(
        f"runtime directory {path}", st, "someone else created it; remove it, or set"
        " agent.socket and nvme.path to a directory of your own",
    )  # fmt: skip
    if st.st_mode & 0o077:
        raise UnsafePath(
            f"runtime directory {path} is open to other users (mode"
            f" {stat.S_IMODE(st.st_mode):04o}); run `chmod 700 {path}` after checking it"
        )


def refuse_foreign(what: str, st: os.stat_result, why: str) -> None:
    """UnsafePath naming ``what`` (whose stat is ``st``) unless this user owns it."""
    if st.st_uid != os.geteuid():
        raise UnsafePath(
            f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): {why}"
        )


def is_inside(path: str, directory: str) -> bool:
    """Whether ``path`` lies in ``directory`` (lexically, after normalising both)."""
    p, d = os.path.abspath(path), os.path.abspath(directory)
    return os.path.commonpath([p, d]) == d
