"""Run folders: where a run's control sockets, token and records live, who may use them, and which runs are live.

    folder = make_run_dir("runs/")            # created 0700; refused unless private to this user
    token = write_token(folder)               # runs/token, created 0600, never over another's file
    token = read_token(folder)                # refused unless a regular file of this user that nobody else reads
    token = run_token(folder)                 # that one, or a new one when there is none (never over a file)
    enlist(socket_path(folder, os.getpid()))  # what `nxl tail` / `nxl ctl` without --run choose from
    live_sockets()                            # [(socket, started)] of this user's processes, newest first

Trust rule (as ssh's StrictModes): a run folder is used only if it is a directory owned by the caller that group
and others cannot write, and every folder above it is owned by the caller or root and writable by others only
with the sticky bit (as /tmp). Otherwise another user could swap the token or the socket under it. Breaking the
rule is a :class:`PermissionError` that says why and what to do (``nxl`` prints it as one line, exit 2).
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import secrets
import socket
import stat
import struct
import tempfile
from pathlib import Path

from ...records.files import unmade, user_path

__all__ = ["bearer", "check_private", "enlist", "live_sockets", "make_run_dir", "peer_uid", "private_run_dir",
           "read_token", "run_token", "socket_path", "tcp_peer_uid", "write_token"]

TOKEN = "token"
_TOKEN_BYTES = 4096  # a token file is one line; a larger one is not a token


def _user_dir() -> Path:
    """This user's private folder in the temporary directory (refused if someone else owns it)."""
    uid = os.getuid()
    folder = Path(tempfile.gettempdir()) / f"nxl-{uid}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(folder)
    if info.st_uid != uid:  # made first by another user: in sticky /tmp, not this user's to remove
        raise PermissionError(f"{folder} belongs to uid {info.st_uid} (another user), not to you (uid {uid}): ask "
                              "them or root to remove it, or pass --sink DIR, or set TMPDIR to a folder of yours")
    if not stat.S_ISDIR(info.st_mode) or info.st_mode & 0o077:
        raise PermissionError(f"{folder} is not a private folder of this user: remove it, or pass --sink DIR")
    return folder


def check_private(folder: Path) -> Path:
    """``folder`` if this user may trust it as a run folder (module docstring), else PermissionError saying why
    and what to do. ``check_private(Path("runs").resolve())``"""
    uid = os.getuid()
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"run folder {folder} is not a directory: give a folder of your own")
    if info.st_uid != uid:
        raise PermissionError(f"run folder {folder} belongs to uid {info.st_uid}, not to you (uid {uid}): its token "
                              "and sockets could be swapped by its owner; use a folder you created")
    if info.st_mode & 0o022:
        raise PermissionError(f"run folder {folder} is writable by group or others (mode "
                              f"{stat.S_IMODE(info.st_mode):o}): run chmod go-w {folder}, or use another folder")
    check_parents(folder)
    return folder


def check_parents(folder: Path) -> None:
    """PermissionError unless every folder above ``folder`` is this user's or root's and nobody else can replace
    what it holds (not writable by group or others, or sticky): ``folder`` cannot be swapped for a link there.
    Folders not there yet are left out (whoever makes them owns them)."""
    uid = os.getuid()
    for parent in folder.parents:
        try:
            above = os.stat(parent)
        except FileNotFoundError:
            continue
        if above.st_uid not in (uid, 0):
            raise PermissionError(f"run folder {folder} lies in {parent}, which belongs to uid {above.st_uid}: "
                                  "its owner could replace the run folder; use a folder under your own")
        if above.st_mode & 0o022 and not above.st_mode & stat.S_ISVTX:
            raise PermissionError(f"run folder {folder} lies in {parent}, which others can write (mode "
                                  f"{stat.S_IMODE(above.st_mode):o}, no sticky bit): they could replace the run "
                                  "folder; use a folder under a private one")


def make_run_dir(path: str | Path) -> Path:
    """``path`` as a run folder: created 0700 (and each missing folder above it), then :func:`check_private`."""
    folder = user_path(path).resolve()
    for missing in reversed([each for each in (folder, *folder.parents) if not each.exists()]):
        try:
            missing.mkdir(mode=0o700, exist_ok=True)
        except OSError as error:  # (/proc, a read-only file system, another user's folder): said with the path given
            raise type(error)(unmade(path, missing, error)) from None
    return check_private(folder)


def private_run_dir() -> Path:
    """A new private run folder in this user's temporary folder."""
    return Path(tempfile.mkdtemp(prefix="run-", dir=_user_dir()))


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (None where the system cannot tell)."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def tcp_peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a TCP connection on this machine, as :func:`peer_uid` tells it of
    a Unix socket: the owner of the server's end, which the kernel lists in ``/proc/net/tcp`` or ``tcp6`` by its
    address and ours (a connection the server has not accepted yet has its listener's owner). An IPv4 connection's
    server end is in ``tcp6`` where it listens on IPv6's any address (dual stack), as ``::ffff:a.b.c.d``, and one
    reached at ``::ffff:a.b.c.d`` is in ``tcp``: both tables are read. None where it cannot be told: no such table,
    or a peer on another machine."""
    try:
        ends = [(ipaddress.ip_address(host.partition("%")[0]), port) for host, port, *_ in
                (sock.getsockname(), sock.getpeername())]
    except (OSError, ValueError):
        return None
    for table, version in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        ours, theirs = (_tcp_address(address, port, version) for address, port in ends)
        if ours is None or theirs is None:
            continue
        try:
            with open(table, encoding="ascii") as fh:
                for line in fh:
                    fields = line.split()
                    if fields[1:3] == [theirs, ours]:
                        return int(fields[7])
        except (OSError, ValueError, IndexError):
            continue
    return None


def _tcp_address(address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int, version: int) -> str | None:
    """``address`` and ``port`` as the table of IP ``version`` writes them (an IPv4 address in ``tcp6`` as
    ``::ffff:a.b.c.d``, an IPv4-mapped one in ``tcp`` as IPv4; None where that table cannot hold it): the
    address's 32-bit words in this machine's byte order, then the port, in hex."""
    if address.version == 4 and version == 6:
        address = ipaddress.IPv6Address(f"::ffff:{address}")
    elif address.version == 6 and version == 4:
        address = address.ipv4_mapped
        if address is None:
            return None
    words = struct.unpack(f"={len(address.packed) // 4}I", address.packed)
    return "".join(f"{word:08X}" for word in words) + f":{port:04X}"


def socket_path(folder: Path, pid: int) -> Path:
    """The control socket of process ``pid`` in a run folder."""
    return folder / f"{pid}.sock"


def _check_secret(path: Path, info: os.stat_result) -> None:
    """A token file must be a regular file of this user that only this user can read or write."""
    if not stat.S_ISREG(info.st_mode):
        raise PermissionError(f"{path} is not a regular file: not a token; remove it")
    if info.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): not using it "
                              "as a token; remove it")
    if info.st_mode & 0o077:
        raise PermissionError(f"{path} has mode {stat.S_IMODE(info.st_mode):o}, so others may have read it: not "
                              f"using it as a token; remove it (nxl run --listen writes a new one, mode 600)")


def write_token(folder: Path) -> str:
    """A new random bearer token in ``folder/token``, created 0600 with O_EXCL (never through a link, never over
    another's file). A token this user left there (an earlier run in the same folder) is replaced; anything else
    there is refused with PermissionError."""
    path = folder / TOKEN
    with contextlib.suppress(FileNotFoundError):
        _check_secret(path, os.lstat(path))
        path.unlink()  # our own token from an earlier run: a new run gets a new token
    try:
        return _new_token(path)
    except FileExistsError:
        raise PermissionError(f"{path} appeared while nxl wrote it: someone else writes in {folder}") from None


def _new_token(path: Path) -> str:
    """A new random token written to ``path``, created 0600 with O_EXCL (FileExistsError when anything is there).
    Written whole to a file of its own first, then linked at ``path`` (link never replaces a file, nor follows a
    link): a reader never finds the file empty, as another process of the run (:func:`run_token`) would have read
    it between its creation and its write, and refused the endpoint a token 'too short to guard anything'."""
    token = secrets.token_urlsafe(32)
    draft = path.with_name(f".{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    _create(draft, token)
    try:
        os.link(draft, path)
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links (some FUSE and SMB mounts): made in place, as before
        _create(path, token)
    finally:
        draft.unlink()
    return token


def _create(path: Path, token: str) -> None:
    """``token`` as the one line of a new file ``path``: 0600, O_EXCL (FileExistsError when anything is there)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        os.fchmod(fh.fileno(), 0o600)  # whatever the umask
        fh.write(token + "\n")


def run_token(folder: Path) -> str:
    """The token of the run in ``folder`` (checked: a private run folder), for its HTTP endpoint: the one in
    ``folder/token``, else a new one written there. nxl run --listen writes it before the program starts; with
    ``import nxl_hooks.auto`` and ``NXL_LISTEN`` no one did, and the endpoint would never serve. Never replaces a
    file: one that another process of the run writes meanwhile is the one read."""
    try:
        return read_token(folder)
    except FileNotFoundError:
        pass
    try:
        return _new_token(folder / TOKEN)
    except FileExistsError:
        return read_token(folder)


def read_token(path: Path) -> str:
    """The token in a token file (or in ``path/token`` for a run folder), once it passed the checks of
    :func:`write_token` (this user's regular file, mode 0600) on the very file opened."""
    path = path / TOKEN if path.is_dir() else path
    try:  # O_NONBLOCK: a FIFO put there does not hang the open; O_NOFOLLOW: a link is not followed
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise FileNotFoundError(f"no token file at {path}: give the token file of the run (RUN_FOLDER/{TOKEN}, "
                                "written by nxl run --listen)") from None
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise PermissionError(f"{path} is a symbolic link: not following it to a token; give the file itself") from None
    with os.fdopen(fd, "rb") as fh:
        _check_secret(path, os.fstat(fh.fileno()))
        return bearer(fh.read(_TOKEN_BYTES).decode("utf-8", "replace").strip(), str(path))


def bearer(token: str, source: str) -> str:
    """``token`` if it can go in an ``Authorization`` header (printable ASCII, no space), else ValueError naming
    ``source``: http.client's own refusal quotes the header, token and all, or names a codec. An empty one (an empty
    file) is no token either: sent, the endpoint's 401 read as a wrong token, not as a file holding none."""
    if not (token and token.isascii() and token.isprintable() and " " not in token):
        raise ValueError(f"{source} does not hold a bearer token (one word of printable ASCII): give the token file "
                         f"nxl run --listen wrote, RUN_FOLDER/{TOKEN}")
    return token


# -- live processes: what the clients choose from without --run -------------------------------------------------

def _live_dir() -> Path:
    folder = _user_dir() / "live"
    folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def enlist(sock: Path) -> Path:
    """Note this process's control socket among this user's live ones (a link ``<pid>`` to it in a private
    folder); the endpoint removes it at exit. Returns the entry."""
    entry = _live_dir() / str(os.getpid())
    with contextlib.suppress(FileNotFoundError):
        entry.unlink()  # an earlier process with this pid: dead, since the pid is ours now
    os.symlink(sock, entry)
    return entry


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's: not ours, but not dead either
        return True
    return True


def live_sockets() -> list[tuple[Path, float]]:
    """(socket, time enlisted) of this user's processes that are alive and whose socket is there, newest first.
    Entries of dead processes are removed here. Whether a socket answers is the client's check. PermissionError
    when the list cannot be read (:func:`_user_dir`: another user made the folder first): "none" would be untrue."""
    found = []
    for entry in _live_dir().iterdir():
        try:
            sock, started = Path(os.readlink(entry)), os.lstat(entry).st_mtime
        except OSError:
            continue
        if not entry.name.isdigit() or not _alive(int(entry.name)) or not sock.is_socket():
            with contextlib.suppress(OSError):
                entry.unlink()
            continue
        found.append((sock, started))
    return sorted(found, key=lambda item: -item[1])
