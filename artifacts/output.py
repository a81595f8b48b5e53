"""Where the commands write, checked before any work and guarded while writing (the "bad input loses
nothing" rule applied to outputs).

``output_file(path, flag)`` runs before a command does its work and returns the path to write to:
it refuses an empty path, a folder, anything that is not a regular file (a device node, a FIFO, a
socket) — a symbolic link to a regular file is written through, the link kept — a folder that does
not exist, and a folder it cannot create a file in (probed by creating and removing one);
``not_an_input`` refuses a file the command reads (checkpoint shards, config, tokenizer), once the
input is open. ``output_folder`` does the same for ``--dump DIR``. ``writing(path, ...)`` turns an
OSError while writing (a full disk, a filesystem turned read-only) into one line, after the
caller's cleanup has removed its partial file.
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile

from kestrel.artifacts.errors import OutputError


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _probe(folder: str, flag: str, path: str) -> None:
    try:
        fd, probe = tempfile.mkstemp(prefix=".kestrel-probe-", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot write in {folder} ({e.strerror}); choose a writable folder") from None


def output_file(path: str, flag: str = "-o") -> str:
    """Check that ``path`` may be written (see the module docstring); returns the real path to write
    (a symbolic link resolved to its target)."""
    if not path:
        raise OutputError(f"{flag}: empty path; give a file path such as model.plan")
    if path.endswith(os.sep) or os.path.isdir(path):
        raise OutputError(f"{flag} {path}: is a folder; give a file path inside it (e.g. {os.path.join(path, 'model.plan')})")
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot check it ({e.strerror})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise OutputError(f"{flag} {path}: exists and is {_kind(st.st_mode)}; refusing to replace it: give a file path")
    folder = os.path.dirname(real)
    if not os.path.isdir(folder):
        raise OutputError(f"{flag} {path}: folder {os.path.dirname(os.path.abspath(path))} does not exist")
    _probe(folder, flag, path)
    return real


def not_an_input(path: str, reading, flag: str = "-o") -> None:
    """Refuse an output that is one of the files the command reads (``reading``)."""
    if not os.path.exists(path):
        return
    for src in reading:
        if os.path.exists(src) and os.path.samefile(path, src):
            raise OutputError(f"{flag} {path}: is {src}, which this command reads; write the output elsewhere")


def output_folder(path: str, flag: str = "--dump") -> str:
    """Check that folder ``path`` may be written: it exists and is a folder, or it does not exist and
    its parent does (the command creates it; missing parents are not made silently). Returns it."""
    if not path:
        raise OutputError(f"{flag}: empty path; give a folder")
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputError(f"{flag} {path}: exists and is not a folder; give a folder")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise OutputError(f"{flag} {path}: folder {parent} does not exist (create it first)")
    _probe(path if os.path.isdir(path) else parent, flag, path)
    return path


@contextlib.contextmanager
def writing(path: str, flag: str = "-o"):
    """Around the write of ``path``: an OSError (a full disk, a read-only filesystem) becomes one line.
    The writer removes its partial file in its own cleanup, which runs before this reports."""
    try:
        yield
    except OSError as e:
        why = e.strerror or str(e)
        raise OutputError(f"{flag} {path}: writing failed ({why}); the partial file was removed") from None
