"""Resolve a model argument (local directory or Hugging Face hub id) to a local directory."""
from __future__ import annotations

import re
from pathlib import Path

from qerl.checkpoint import CheckpointError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: Files a causal LM needs; skips *.bin/*.pt/*.pth/onnx duplicates of the weights.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken", "*.py"]


def resolve_model_dir(src: str | Path, revision: str | None = None) -> Path:
    """A local model directory for ``src``; downloads hub ids with ``huggingface_hub``.

    Raises :class:`CheckpointError` with what to do when the path is missing or the hub cannot be
    reached (no network, gated repository without a token, offline mode without a cache).
    """
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path}: expected a model directory, found a file")
        if not (path / "config.json").exists():
            raise CheckpointError(f"{path}: not a Hugging Face model directory (no config.json)")
        return path
    if not _HUB_ID.match(str(src)):
        raise CheckpointError(f"{src}: no such model directory (and not a hub id like 'Qwen/Qwen2.5-7B-Instruct')")
    return download(str(src), revision)


def download(repo: str, revision: str | None = None, local_dir: str | Path | None = None) -> Path:
    """Snapshot ``repo`` (weights, config, tokenizer) at ``revision`` into the HF cache or
    ``local_dir``; failures become a :class:`CheckpointError` that says what to do."""
    from huggingface_hub import snapshot_download

    if _offline():  # the hub is off (a compute node after `qerl fetch`): the cache's snapshot, linked into local_dir
        try:
            cached = Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_PATTERNS,
                                            local_files_only=True))
        except Exception:
            raise CheckpointError(
                f"{repo!r}{f' at revision {revision}' if revision else ''} is not in this machine's Hugging Face "
                "cache and the hub is off (HF_HUB_OFFLINE): run `qerl fetch --configfile <config>` on a machine "
                "with network and copy its cache (HF_HOME) here") from None
        return cached if local_dir is None else _link_snapshot(cached, Path(local_dir))
    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_PATTERNS,
                                      local_dir=None if local_dir is None else str(local_dir)))
    except Exception as e:  # network, auth, offline-mode and not-found errors all land here
        raise CheckpointError(
            f"could not fetch {repo!r}{f' at revision {revision}' if revision else ''} from the "
            f"Hugging Face hub ({type(e).__name__}: {e}). If the machine has no network, download "
            "the model elsewhere and pass its local directory, or set HF_HUB_OFFLINE=1 to use a "
            "cached copy; for gated models set HF_TOKEN."
        ) from None


def _offline() -> bool:
    import os

    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _link_snapshot(cached: Path, local_dir: Path) -> Path:
    """``local_dir`` holding symlinks to a cached snapshot's files (no copy of the weights)."""
    import os

    for f in cached.rglob("*"):
        if f.is_file():
            dest = local_dir / f.relative_to(cached)
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.is_symlink() or dest.exists():
                dest.unlink()
            os.symlink(f.resolve(), dest)
    return local_dir
