"""Safetensors checkpoint I/O: lazy tensor index, validated reads, atomic directory writes.

Reads never load a whole shard: :class:`TensorIndex` maps tensor names to shard files from the
headers only, and tensors are read one at a time. Writes go to a temporary sibling directory that
is renamed into place only when complete, so a crash never leaves a checkpoint that looks whole.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

WEIGHT_SUFFIXES = (".safetensors",)
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory or file is missing, unreadable, truncated or inconsistent."""


def read_json(path: Path) -> dict:
    """Read a JSON file, raising :class:`CheckpointError` that names it on failure."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def write_json(path: Path, obj) -> None:
    """Write JSON atomically (:func:`qerl.files.write_json`)."""
    from qerl.files import write_json as _write

    _write(path, obj)


def shard_files(model_dir: Path) -> list[Path]:
    """The safetensors shards of a model directory (from the index when there is one)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: not a directory")
    index = model_dir / INDEX_NAME
    if index.exists():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: has no 'weight_map'")
        files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index}: lists shard(s) that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in model_dir.glob("*.bin"))
        hint = f" (found {bins}: convert to safetensors first)" if bins else ""
        raise CheckpointError(f"{model_dir}: no *.safetensors weight files{hint}")
    return files


class TensorIndex:
    """Name -> (shard, dtype, shape) for every tensor of a checkpoint, from the headers only."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.location: dict[str, Path] = {}
        self.meta: dict[str, tuple[str, tuple[int, ...]]] = {}
        for shard in shard_files(self.model_dir):
            with _open(shard) as f:
                for name in f.keys():
                    if name in self.location:
                        raise CheckpointError(
                            f"{shard}: tensor {name!r} also appears in {self.location[name]}"
                        )
                    sl = f.get_slice(name)
                    self.location[name] = shard
                    self.meta[name] = (sl.get_dtype(), tuple(sl.get_shape()))

    def __contains__(self, name: str) -> bool:
        return name in self.location

    def names(self) -> list[str]:
        return list(self.location)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.meta[name][1]

    def nbytes(self, name: str) -> int:
        dtype, shape = self.meta[name]
        n = 1
        for d in shape:
            n *= d
        return n * _DTYPE_BYTES.get(dtype, 4)

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (a copy in host memory)."""
        if name not in self.location:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} is missing from the checkpoint")
        shard = self.location[name]
        try:
            with safe_open(shard, framework="pt") as f:
                return f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{shard}: cannot read tensor {name!r}: {e}") from None


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "F8_E4M3": 1,
                "I32": 4, "I64": 8, "BOOL": 1}


@contextlib.contextmanager
def _open(shard: Path):
    try:
        f = safe_open(shard, framework="pt")
    except Exception as e:
        size = shard.stat().st_size if shard.exists() else 0
        raise CheckpointError(
            f"{shard}: not a readable safetensors file ({size} bytes; truncated or corrupt?): {e}"
        ) from None
    with f:
        yield f


def save_shard(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    """Save one safetensors shard (contiguous tensors, ``format=pt`` metadata)."""
    meta = {"format": "pt", **(metadata or {})}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=meta)


def parse_size(size: str | int) -> int:
    """'2GB' / '500MB' / '1GiB' / int -> bytes (> 0); anything else is a ValueError naming the flag."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        s = str(size).strip().upper()
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
        mult = next((m for u, m in units.items() if s.endswith(u)), 1)
        num = next((s[: -len(u)] for u in units if s.endswith(u)), s)
        try:
            n = int(float(num) * mult)
        except (ValueError, OverflowError):
            raise ValueError(f"--max-shard-size {size!r}: expected a size such as 500MB, 2GB or 1GiB") from None
    if n <= 0:
        raise ValueError(f"--max-shard-size {size!r}: must be > 0 bytes")
    return n


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """The sha256 of a file's bytes (hex), read in chunks."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_nonempty_dir(path: Path) -> bool:
    return Path(path).is_dir() and any(Path(path).iterdir())


@contextlib.contextmanager
def atomic_directory(dst: Path, force: bool = False, written_by: str = "qerl") -> Iterator[Path]:
    """Yield a temporary directory beside ``dst``; on success it replaces ``dst`` atomically, with its manifest
    (:mod:`qerl.owned`: every file written, ``written_by`` the command).

    On any exception the temporary directory is removed and ``dst`` is left as it was. An existing
    ``dst`` is replaced only with ``force`` (callers decide what counts as "the same model"), and only when
    everything in it is qerl's (:func:`qerl.owned.check_replaceable`, before the block runs). The
    replacement is one exchange of the two directories (Linux ``renameat2(RENAME_EXCHANGE)``), so a
    complete ``dst`` exists at every instant; where the file system cannot exchange (NFS), the old
    directory is moved aside first and :func:`recover_swap` finds the newest complete one after a crash.
    """
    from qerl import owned

    dst = Path(dst)
    if is_nonempty_dir(dst) and not force:
        raise CheckpointError(f"{dst}: already exists and is not empty (use --force to replace)")
    if dst.is_symlink() or (dst.exists() and not dst.is_dir()):
        raise CheckpointError(f"{dst}: exists and is not a directory" + (" (a symbolic link)" if dst.is_symlink()
                                                                          else ""))
    owned.check_replaceable(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        err = as_os_error(e, dst)
        if err is not None:
            raise err from None
        raise
    owned.write(tmp, written_by)
    _sync_tree(tmp)
    fault("written")
    if dst.exists() and fault_point() != "aside" and _exchange(tmp, dst):
        fault("swapped")
        shutil.rmtree(tmp, ignore_errors=True)  # (now the old directory)
        return
    old = None
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(dst, old)
        fault("aside")
    os.replace(tmp, dst)
    fault("swapped")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def as_os_error(e: BaseException, path: Path) -> OSError | None:
    """A write failure that a library reports as its own type (safetensors' ``SafetensorError``, torch.save's
    ``RuntimeError: ... file write failed``) as the ``OSError`` it is, naming ``path``; None for anything else."""
    import errno

    if isinstance(e, OSError) or not isinstance(e, Exception):
        return None
    text = str(e)
    if "No space left" in text or "os error 28" in text:
        return OSError(errno.ENOSPC, "No space left on device", str(path))
    if "Read-only file system" in text or "os error 30" in text:
        return OSError(errno.EROFS, "Read-only file system", str(path))
    if "I/O error" in text or "write failed" in text:
        return OSError(errno.EIO, text.splitlines()[0], str(path))
    return None


def recover_swap(dst: Path, version, is_complete) -> str | None:
    """Finish a replacement of ``dst`` that a crash interrupted: among ``dst`` and the ``.<name>.tmp-*`` /
    ``.<name>.old-*`` directories beside it, the complete one (``is_complete(dir)``) with the highest
    ``version(dir)`` becomes ``dst``; the others are removed. Returns a note of what was done, or None when
    there was nothing to recover."""
    dst = Path(dst)
    leftovers = sorted(p for pat in (f".{dst.name}.tmp-*", f".{dst.name}.old-*") for p in dst.parent.glob(pat)
                       if p.is_dir())
    if not leftovers:
        return None
    cands = [p for p in ([dst] if dst.is_dir() else []) + leftovers if is_complete(p)]
    best = max(cands, key=version, default=None)
    note = None
    if best is not None and best != dst:
        if dst.is_dir():
            if not _exchange(best, dst):
                aside = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
                os.replace(dst, aside)
                os.replace(best, dst)
                best = aside
        else:
            os.replace(best, dst)
        note = f"{dst}: recovered the complete version {version(dst)} left by an interrupted replacement"
    for p in dst.parent.glob(f".{dst.name}.tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
    for p in dst.parent.glob(f".{dst.name}.old-*"):
        shutil.rmtree(p, ignore_errors=True)
    return note


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (``renameat2(RENAME_EXCHANGE)``); False where the kernel, the C library or the
    file system cannot."""
    import ctypes
    import errno

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def umask_mode(directory: bool = False) -> int:
    """The mode a new file (or directory) gets under the process's umask: 0o644 / 0o755 with the usual 022."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def _sync_tree(root: Path) -> None:
    """fsync every file of a finished directory, then the directory, before it is renamed into place (a power
    loss must not leave a renamed directory of empty files). Every file gets the umask's mode on the way: the
    safetensors writer makes its files 0600, which a group-shared results directory cannot read."""
    fmode, dmode = umask_mode(), umask_mode(directory=True)
    for dirpath, dirs, files in os.walk(root):
        os.chmod(dirpath, dmode)
        for name in files:
            os.chmod(os.path.join(dirpath, name), fmode)
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fault_point() -> str:
    """Test hook: ``QERL_FAULT_CHECKPOINT=POINT[:K]`` kills the process (SIGKILL, no cleanup) the K-th time (default
    1st) :func:`atomic_directory`'s replacement reaches POINT: ``written`` (the new directory complete, not in
    place), ``aside`` (the old one moved aside: forces the two-rename path of file systems without an exchange),
    ``swapped`` (the new one in place, the old not yet removed). How tests/train/test_ownership.py checks that no
    instant is without a complete checkpoint."""
    return os.environ.get("QERL_FAULT_CHECKPOINT", "").partition(":")[0]


_FAULT_SEEN: dict[str, int] = {}


def fault(point: str) -> None:
    spec = os.environ.get("QERL_FAULT_CHECKPOINT", "")
    name, _, k = spec.partition(":")
    if name != point:
        return
    _FAULT_SEEN[point] = _FAULT_SEEN.get(point, 0) + 1
    if _FAULT_SEEN[point] == int(k or 1):
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
