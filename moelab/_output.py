"""One way to write an output (trace, eval results, predictor, trained model, report): atomically.

>>> with reserve_output("runs/trace1", overwrite=False, what="trace directory") as out:
...     write_everything_into(out.staging)   # .trace1.partial-XXXXXXXX next to the target
...     out.commit()                         # swapped into place in one step

What the reservation guarantees, for every writer that goes through it:

* **Refused before the work.** An existing target (also a dangling symlink) is refused
  unless ``overwrite``; missing parent directories are created; an unwritable parent
  fails here, not after a long run.
* **One writer per target.** The staging entry is created at the reservation and held
  under an ``flock`` until the commit; a second writer of the same target finds a locked
  ``.<name>.partial-*`` and is refused at once (the check runs under a short lock of the
  parent directory, so two writers cannot both pass it). No lock file is left behind.
* **Never anything that looks complete but isn't.** Outputs are written into a sibling
  ``.<name>.partial-*`` and renamed into place only when complete. Leftover
  ``.<name>.partial-*`` (unlocked: their writer is dead) and ``.<name>.old-*`` entries of
  interrupted runs are removed by the next writer of that target.
* **Something complete is always at the path.** On Linux, replacing an existing output
  uses ``renameat2(RENAME_EXCHANGE)``: the new output and the old one trade places in one
  step, then the old one is deleted. Where that call is unavailable (other systems,
  some filesystems) the old output is first renamed aside and the new one renamed in:
  two renames, between which (microseconds) nothing is at the path.
* **Normal permissions.** Staging directories are made by ``mkdtemp`` (mode 0700); they
  are given ``0777 & ~umask`` (files ``0666 & ~umask``) before the commit.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

from moelab.errors import MoelabError

log = logging.getLogger(__name__)

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _renameat2(src: Path, dst: Path, flags: int) -> bool:
    """``renameat2(src, dst, flags)``; False where the call or the flag is unsupported."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _normal_permissions(root: Path) -> None:
    """Files written 0600 by some writers (safetensors, mkstemp) get ``0666 & ~umask``;
    directories ``0777 & ~umask``. Symlinks are left alone."""
    mask = _umask()
    if root.is_symlink():
        return
    if root.is_file():
        os.chmod(root, 0o666 & ~mask)
        return
    os.chmod(root, 0o777 & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o777 & ~mask)
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~mask)


class OutputReservation:
    """A claimed output path; see the module docstring. Use :func:`reserve_output`."""

    def __init__(self, path: str | os.PathLike, *, overwrite: bool = False, what: str = "output",
                 hint: str = "pass overwrite=True (CLI: --overwrite) or choose another path",
                 kind: str = "dir") -> None:
        if kind not in ("dir", "file"):
            raise ValueError(f"kind must be 'dir' or 'file', got {kind!r}")
        self.path = Path(path).expanduser()
        self.overwrite = overwrite
        self.what = what
        self.hint = hint
        self.kind = kind
        self.committed = False
        self.staging: Path | None = None
        self._lock_fd: int | None = None
        self._acquire()

    # ------------------------------------------------------------------ claim
    def _refuse_existing(self) -> None:
        if os.path.lexists(self.path) and not self.overwrite:
            kind = "is a dangling symlink" if not self.path.exists() else "already exists"
            raise MoelabError(f"{self.what} {str(self.path)!r} {kind}; {self.hint}.")

    def _acquire(self) -> None:
        if not self.path.name or self.path.name in (".", ".."):
            raise MoelabError(f"{self.what} {str(self.path)!r} is not a usable path; name a file or directory.")
        self._refuse_existing()
        parent = self.path.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise MoelabError(
                f"cannot create {self.what} {str(self.path)!r}: a parent of it is a file, not a directory."
            ) from None
        except PermissionError:
            raise MoelabError(
                f"cannot create {self.what} {str(self.path)!r}: no permission to create {str(parent)!r}."
            ) from None
        pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(pfd, fcntl.LOCK_EX)  # held for the claim only (milliseconds)
            self._refuse_existing()  # it may have appeared meanwhile
            self._clean_leftovers()
            try:
                if self.kind == "dir":
                    tmp = tempfile.mkdtemp(prefix=f".{self.path.name}.partial-", dir=parent)
                    os.chmod(tmp, 0o777 & ~_umask())
                else:
                    fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.partial-", dir=parent)
                    os.close(fd)
                    os.chmod(tmp, 0o666 & ~_umask())
            except PermissionError:
                raise MoelabError(
                    f"cannot write {self.what} {str(self.path)!r}: no permission to write in {str(parent)!r}."
                ) from None
            self.staging = Path(tmp)
            self._lock_fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(pfd)  # releases the parent's lock

    def _clean_leftovers(self) -> None:
        pattern = re.compile(rf"^\.{re.escape(self.path.name)}\.(partial|old)-[A-Za-z0-9_]{{8}}$")
        for entry in self.path.parent.iterdir():
            m = pattern.match(entry.name)
            if not m:
                continue
            if m.group(1) == "partial":
                try:
                    fd = os.open(entry, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise MoelabError(
                        f"{self.what} {str(self.path)!r} is being written by another process (its "
                        f"staging {entry.name!r} is in use); wait for it to finish or choose another path."
                    ) from None
                finally:
                    os.close(fd)
            log.info("removing %s, left by an interrupted write of %s", entry, self.path)
            _remove(entry)

    # ------------------------------------------------------------------ write
    def commit(self) -> Path:
        """Put the complete :attr:`staging` at the path (see the module docstring)."""
        staged = self.staging
        if staged is None or self._lock_fd is None:
            raise MoelabError(f"the reservation of {str(self.path)!r} is closed; reserve it again.")
        _normal_permissions(staged)
        if os.path.lexists(self.path):
            if not self.overwrite:
                raise MoelabError(f"{self.what} {str(self.path)!r} appeared while writing it; {self.hint}.")
            if staged.is_file() and self.path.is_file() and not self.path.is_symlink():
                os.replace(staged, self.path)
            elif _renameat2(staged, self.path, _RENAME_EXCHANGE):
                _remove(staged)  # it holds the old output now
            else:  # two renames: a moment without anything at the path (see module docstring)
                trash = self.path.with_name(f".{self.path.name}.old-{uuid.uuid4().hex[:8]}")
                os.replace(self.path, trash)
                os.replace(staged, self.path)
                _remove(trash)
        elif not _renameat2(staged, self.path, _RENAME_NOREPLACE):
            os.replace(staged, self.path)
        self.staging = None
        self.committed = True
        self.release()
        return self.path

    def abort(self) -> None:
        """Remove the staging entry and release the claim (nothing appears at the path)."""
        if self.staging is not None:
            _remove(self.staging)
            self.staging = None
        self.release()

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> OutputReservation:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.abort()
        return False


def reserve_output(path: str | os.PathLike, overwrite: bool = False, *, what: str = "output",
                   hint: str = "pass overwrite=True (CLI: --overwrite) or choose another path",
                   kind: str = "dir") -> OutputReservation:
    """Claim ``path`` for one atomic write (see the module docstring); a context manager.

    ``kind`` is ``"dir"`` (``staging`` is an empty directory) or ``"file"`` (an empty file).
    """
    return OutputReservation(path, overwrite=overwrite, what=what, hint=hint, kind=kind)


def write_file_atomic(path: str | os.PathLike, data: str | bytes) -> Path:
    """Write one small file atomically: a unique sibling temp file (``0666 & ~umask``), renamed
    into place when complete (two writers never share a temp name; a failed write leaves none)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path
