"""Run folders: where a run's control sockets, token and records live, and how the clients find the last one.

    folder = make_run_dir("runs/")            # 0700 when created here
    token = write_token(folder)               # runs/token, 0600: the HTTP endpoint's bearer token
    last_run()                                # the folder of the last `nxl run` of this user, for `nxl tail`
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
from pathlib import Path

from ...records.files import write_text

__all__ = ["last_run", "make_run_dir", "private_run_dir", "read_token", "remember", "socket_path", "write_token"]

TOKEN = "token"


def _user_dir() -> Path:
    """This user's private folder in the temporary directory (refused if someone else owns it)."""
    folder = Path(tempfile.gettempdir()) / f"nxl-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} is not a private folder of this user: remove it, or pass --sink DIR")
    return folder


def make_run_dir(path: str | Path) -> Path:
    """``path`` as a run folder (created 0700 if missing)."""
    folder = Path(path).expanduser().resolve()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder


def private_run_dir() -> Path:
    """A new private run folder in this user's temporary folder, remembered as the last run."""
    folder = Path(tempfile.mkdtemp(prefix="run-", dir=_user_dir()))
    remember(folder)
    return folder


def remember(folder: Path) -> None:
    """Make ``folder`` what ``nxl tail`` / ``nxl ctl`` talk to when given no run."""
    write_text(_user_dir() / "last-run", str(folder))


def last_run() -> Path | None:
    try:
        return Path((_user_dir() / "last-run").read_text().strip())
    except (OSError, PermissionError):
        return None


def socket_path(folder: Path, pid: int) -> Path:
    """The control socket of process ``pid`` in a run folder."""
    return folder / f"{pid}.sock"


def write_token(folder: Path) -> str:
    """A new random bearer token in ``folder/token`` (0600, replacing an old one)."""
    token = secrets.token_urlsafe(32)
    write_text(folder / TOKEN, token + "\n", mode=0o600)
    return token


def read_token(path: Path) -> str:
    """The token in a token file (or in ``path/token`` for a run folder)."""
    path = path / TOKEN if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"no token file at {path}: give the token file of the run (RUN_FOLDER/{TOKEN}, "
                                "written by nxl run --listen)")
    return path.read_text().strip()
