"""Writing a folder (a checkpoint, an export) so that no one ever sees half of it, and
nothing the user did not create is replaced.

A folder is written into a hidden sibling ``.NAME.lowbit-tmp-XXXXXXXX`` and renamed into
place at the end.  Replacing an existing folder (only with ``overwrite``, and only one
the writer's ``replaceable`` test accepts as its own) moves the old one aside
(``-old-``), renames the new one in, then deletes the old one; a failure at any point,
Ctrl-C included, puts the old one back, and if even that is interrupted the next
``check_output_dir`` on the same path does.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from pathlib import Path


def _sibling(parent: Path, name: str, kind: str) -> Path:
    """A new, empty hidden folder ``.NAME.lowbit-KIND-XXXXXXXX`` in ``parent``, made with
    the umask's permissions (``tempfile.mkdtemp`` makes 0700, which a rename keeps)."""
    while True:
        p = parent / f".{name}.lowbit-{kind}-{secrets.token_hex(4)}"
        try:
            os.mkdir(p, 0o777)
            return p
        except FileExistsError:
            continue


def _siblings(out: Path, kind: str) -> list[Path]:
    pattern = re.compile(rf"\.{re.escape(out.name)}\.lowbit-{kind}-[0-9a-f]{{8}}")
    try:
        return sorted(out.parent / e.name for e in os.scandir(out.parent)
                      if pattern.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def _discard(out: Path, backup: Path) -> None:
    """Delete the backup of ``out``: renamed to a ``-del-`` folder first (atomic), so an
    ``-old-`` folder always holds a whole folder and a half-deleted one is never
    put back.  Failing that, it stays for the next run to delete."""
    gone = _sibling(out.parent, out.name, "del")
    try:
        os.rename(backup, gone / "x")
    except OSError:
        pass
    shutil.rmtree(gone, ignore_errors=True)


def _recover(out: Path, replaceable) -> None:
    """Finish what an interrupted replacement of ``out`` left: put the old folder
    back when ``out`` is missing, delete it when ``out`` is there (the new one)."""
    for d in _siblings(out, "del"):
        shutil.rmtree(d, ignore_errors=True)
    for d in _siblings(out, "old"):
        old = d / "x"
        if not os.path.lexists(old):  # made, then interrupted before the move
            try:
                os.rmdir(d)
            except OSError:
                pass
        elif os.path.lexists(out):
            _discard(out, d)
        elif replaceable(old) is None:
            os.rename(old, out)
            os.rmdir(d)


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` onto the folder ``out``; on any failure (Ctrl-C included) the
    old one is put back, and if even that is interrupted ``_recover`` puts it back."""
    backup = _sibling(out.parent, out.name, "old")
    old = backup / "x"
    try:
        os.rename(out, old)
        os.rename(tmp, out)
    except BaseException:
        if os.path.lexists(old) and not os.path.lexists(out):
            os.rename(old, out)
        if not os.path.lexists(old):
            os.rmdir(backup)
        raise
    _discard(out, backup)


def check_output_dir(path: str | os.PathLike, overwrite: bool, *, replaceable, what: str) -> Path:
    """Check, before any work, that the folder ``path`` can be written; returns ``path``
    as a Path.

    ``path`` must not exist, unless ``overwrite`` and ``replaceable(path)`` returns None
    (any other return value is the reason it is not the writer's own folder, named in the
    error; ``what`` names the kind of folder).  Its nearest existing parent must be a
    folder this process can create folders in.  A folder that an interrupted replacement
    left aside (hidden ``.NAME.lowbit-old-*``) is put back first.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False, or it is not
            replaceable.
        NotADirectoryError: a parent of ``path`` is not a folder.
        PermissionError: the folder would be written in cannot be written.

    Example::

        >>> import tempfile
        >>> never = lambda p: "is not mine"
        >>> with tempfile.TemporaryDirectory() as d:
        ...     ok = check_output_dir(d + "/new", False, replaceable=never, what="report")
        ...     check_output_dir(d, True, replaceable=never, what="report")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        FileExistsError: '...' exists and is not mine; refusing to replace it
    """
    given = Path(path)
    out = Path(os.path.abspath(given))
    if out.parent == out:
        raise FileExistsError(f"{str(given)!r} is a file system root; a {what} needs a folder of its own")
    _recover(out, replaceable)
    if os.path.lexists(out):
        if not overwrite:
            raise FileExistsError(f"{str(given)!r} exists; pass overwrite=True (CLI: --force) to replace it")
        why = replaceable(out)
        if why is not None:
            raise FileExistsError(f"{str(given)!r} exists and {why}; refusing to replace it")
    parent = out.parent
    while not os.path.lexists(parent):
        parent = parent.parent
    if not parent.is_dir():
        raise NotADirectoryError(f"cannot write {str(given)!r}: {str(parent)!r} is not a folder")
    try:  # making a folder is the real test (root passes os.access on a read-only file system)
        os.rmdir(_sibling(parent, out.name, "probe"))
    except OSError as e:
        raise PermissionError(f"cannot write {str(given)!r}: cannot create a folder in {str(parent)!r} "
                              f"({e.strerror or e})") from None
    return given


@contextlib.contextmanager
def staging(path: str | os.PathLike, overwrite: bool, *, replaceable, what: str):
    """A new hidden folder beside ``path`` to write into; when the block ends without an
    error it replaces ``path`` atomically (``check_output_dir`` runs first, and again
    before a replacement), else it is deleted.

    Example::

        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as d:
        ...     with staging(d + "/out", False, replaceable=lambda p: None, what="report") as tmp:
        ...         _ = (tmp / "a.txt").write_text("done")
        ...     sorted(p.name for p in Path(d).iterdir())
        ['out']
    """
    given = check_output_dir(path, overwrite, replaceable=replaceable, what=what)
    out = Path(os.path.abspath(given))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out.parent, out.name, "tmp")
    try:
        yield tmp
        # safetensors writes 0600; every file gets what the umask gave the folder
        file_mode = tmp.stat().st_mode & 0o666
        for f in tmp.iterdir():
            if f.is_file():
                os.chmod(f, file_mode)
        if os.path.lexists(out):
            check_output_dir(given, overwrite, replaceable=replaceable, what=what)  # still ours after the writing
            _replace(tmp, out)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = ["check_output_dir", "staging"]


def cache_dir() -> Path:
    """Where lowbit caches what it derives (converted models, kernel calibrations):
    ``$LOWBIT_CACHE`` or ``~/.cache/lowbit``."""
    return Path(os.environ.get("LOWBIT_CACHE") or Path.home() / ".cache" / "lowbit")
