"""Output paths a command owns: an exclusive lock for the command's lifetime, and writability checked up front.

Every writer of an output (``qerl train`` / ``evaluate`` / ``quantize`` / ``report``) holds
:func:`hold` on it while it runs, so a second process aimed at the same output fails at once with
"<path> is in use by PID n" instead of interleaving its files with the first one's. The lock is an
``flock`` on a hidden file beside the output (``.<name>.lock`` in its parent: an output directory
written by an atomic rename stays lockable while it is replaced); the kernel drops it when the process
exits, however it exits, so a killed run leaves nothing to clean up. No torch here.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

HELD_ENV = "QERL_HELD_OUTPUTS"  # outputs locked by a parent process (the launcher of torchrun's ranks)


class OutputInUse(RuntimeError):
    """Another process holds the output this command would write."""


class OutputNotWritable(OSError):
    """An output path cannot be created or written (read-only file system, a file in the way, no permission)."""


def lock_path(output: Path) -> Path:
    output = Path(output).absolute()
    return output.parent / f".{output.name}.lock"


def held_by_parent(output: Path) -> bool:
    held = os.environ.get(HELD_ENV, "")
    return str(Path(output).absolute()) in held.split(os.pathsep)


@contextlib.contextmanager
def hold(output: Path, what: str = "output") -> Iterator[Path]:
    """Hold an exclusive lock on ``output`` (a file or directory path) until the block exits.

    Raises :class:`OutputInUse` naming the holder's PID when another process holds it. A lock file
    replaced between its ``open`` and its ``flock`` (the holder removed it on exit) is opened again,
    so two processes never both think they own one output. Processes started inside the block inherit
    the ownership through ``$QERL_HELD_OUTPUTS`` (torchrun's ranks of one ``qerl train``)."""
    output = Path(output).absolute()
    if held_by_parent(output):
        yield output
        return
    output.parent.mkdir(parents=True, exist_ok=True)  # (writability: the callers' check_* first, in their words)
    path = lock_path(output)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise OutputInUse(f"{output} is in use by PID {pid} (another qerl {what} writes it; wait for it to "
                              f"finish or stop it)") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # removed or replaced by the previous holder as it exited: lock the current file
    with contextlib.suppress(OSError):  # (the PID is for the message of a second writer; a full disk skips it)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    before = os.environ.get(HELD_ENV)
    os.environ[HELD_ENV] = os.pathsep.join(filter(None, [before, str(output)]))
    try:
        yield output
    finally:
        if before is None:
            os.environ.pop(HELD_ENV, None)
        else:
            os.environ[HELD_ENV] = before
        with contextlib.suppress(OSError):
            os.unlink(path)  # while still locked: a waiting opener sees the inode change and retries
        os.close(fd)


def check_not_input(output: Path, inputs: dict[str, object], flag: str = "--output") -> None:
    """``output`` is not one of the command's inputs and does not contain one (replacing it would delete that
    input): ``inputs`` maps a flag to a local path (hub ids and None are skipped)."""
    out = Path(output).absolute().resolve()
    for name, value in inputs.items():
        if not value or not Path(str(value)).exists():
            continue
        inp = Path(str(value)).absolute().resolve()
        if out == inp or out in inp.parents:
            rel = "is" if out == inp else "contains"
            raise OutputNotWritable(f"{flag} {output} {rel} the input {name} {value}: writing it would destroy that "
                                    f"input; choose another {flag}")


def check_parent_writable(output: Path, what: str = "output") -> None:
    """The directory that will hold ``output`` exists (or can be created) and can be written."""
    output = Path(output).absolute()
    parent = output.parent
    for p in [parent, *parent.parents]:
        if p.exists():
            if not p.is_dir():
                raise OutputNotWritable(f"{output}: cannot create the {what} there: {p} is a file, not a directory")
            break
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputNotWritable(f"{output}: cannot create the {what} directory {parent}: {_reason(e)}") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputNotWritable(f"{output}: cannot write the {what} there: {parent} is not writable")


def check_dir_writable(directory: Path, what: str = "output directory") -> None:
    """``directory`` is a directory (created if missing) in which a file can be created: checked by creating
    one, so a read-only mount or a full quota is found before any work starts."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise OutputNotWritable(f"{directory}: the {what} is a file, not a directory")
    check_parent_writable(directory, what)
    probe = directory / f".qerl-write-test-{os.getpid()}"
    try:
        directory.mkdir(exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise OutputNotWritable(f"{directory}: cannot write the {what}: {_reason(e)}") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def check_file_output(path: Path, what: str = "output file") -> None:
    """``path`` can be written as a file: not a directory, its directory writable."""
    path = Path(path)
    if path.is_dir():
        raise OutputNotWritable(f"{path}: the {what} is an existing directory; give a file path (e.g. {path}/out.json)")
    check_dir_writable(path.absolute().parent, f"directory of the {what}")


def _reason(e: OSError) -> str:
    if e.errno == errno.ENOSPC:
        return "no space left on the device"
    if e.errno == errno.EROFS:
        return "read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return e.strerror or str(e)


def describe_os_error(e: OSError, output=None) -> str:
    """One line for an ``OSError`` a command hit while writing: the path (``output`` when the error names none)
    and the plain reason."""
    where = e.filename or (f"writing {output}" if output else "a file")
    return f"{where}: {_reason(e)}"
