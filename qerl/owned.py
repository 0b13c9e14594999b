"""What a qerl command owns in a directory it wrote, and so what ``--force`` / ``--overwrite`` may remove.

Every directory written whole by a qerl command (a model from ``build-tiny`` / ``from-gguf`` / ``quantize`` /
``export-merged``, an adapter, a training checkpoint: everything :func:`qerl.checkpoint.atomic_directory` writes)
carries a manifest, ``qerl_files.json``: each file it wrote, with its size and its sha256 (weights too: a file
zeroed or edited at the same size is caught, at one read of the directory when it is checked).

* **Replacing** a directory (``--force``) is allowed only when everything in it is owned: listed by its manifest,
  or, for a directory written before manifests existed, a file of a known model-directory name. Anything else —
  a user's file, a nested directory, a symbolic link — is *in the way*: refused before anything is deleted, with
  one line naming it (:func:`check_replaceable`).
* **Done** means every listed file is there unchanged (:func:`changed`): an output whose files no longer match
  its manifest is never taken as up to date.

No torch here (light: imported by the CLI before any heavy work).
"""
from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import uuid
from pathlib import Path

from qerl.outputs import OutputNotWritable

MANIFEST = "qerl_files.json"
# what a qerl command written before manifests existed may have put in a directory (a model's Hugging Face and
# qerl files, a training checkpoint's): such a directory is replaceable when it holds nothing else
LEGACY_FILES = ("config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
                "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json", "qerl_*.json",
                "quantization_report.json", "adapter_config.json", "README.md", "trainer_state.json",
                "trainer_state.pt")
LEGACY_DIRS = ("adapter", "dcp")  # a checkpoint's PEFT adapter and FSDP2 shards (with everything in them)


class NotOwned(OutputNotWritable):
    """A directory holds something no qerl command wrote there: replacing it would destroy it."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _entries(directory: Path) -> list[tuple[str, Path]]:
    """Every entry under ``directory`` (relative POSIX path, path), links not followed, the manifest left out."""
    out = []
    for root, dirs, files in os.walk(directory, followlinks=False):
        for name in dirs + files:
            p = Path(root) / name
            rel = p.relative_to(directory).as_posix()
            if rel != MANIFEST:
                out.append((rel, p))
    return out


def write(directory: Path, command: str) -> dict:
    """List every regular file under ``directory`` in its manifest (written last, atomically); returns it."""
    directory = Path(directory)
    files = {}
    for rel, p in _entries(directory):
        if p.is_symlink():
            raise NotOwned(f"{p}: a symbolic link in an output qerl writes (qerl writes none)")
        if p.is_file():
            size = p.stat().st_size
            files[rel] = {"bytes": size, "sha256": _sha256(p)}
    # ``written``: this write's identity (a run trained on the directory records it, and a rerun after the directory
    # was rewritten, even to files of the same sizes, starts over: qerl.train.ownership)
    manifest = {"written_by": command, "written": uuid.uuid4().hex, "files": dict(sorted(files.items()))}
    from qerl.files import write_json

    write_json(directory / MANIFEST, manifest, indent=1)
    return manifest


def read(directory: Path) -> dict | None:
    """The manifest of ``directory``, None where there is none; an unreadable one is an error naming it."""
    f = Path(directory) / MANIFEST
    if not f.is_file() or f.is_symlink():
        return None
    try:
        data = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise NotOwned(f"{f}: not a qerl manifest ({e}); remove the directory yourself or choose another "
                       "output") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise NotOwned(f"{f}: not a qerl manifest (no 'files' mapping)")
    return data


def written_id(directory: Path) -> str | None:
    """The identity of the write that made ``directory`` (its manifest's ``written``), None without one."""
    try:
        return (read(directory) or {}).get("written")
    except NotOwned:
        return None


def _legacy_owned(rel: str, p: Path) -> bool:
    top, _, rest = rel.partition("/")
    if p.is_symlink():
        return False
    if top in LEGACY_DIRS:
        return True
    return not rest and p.is_file() and any(fnmatch.fnmatch(rel, pat) for pat in LEGACY_FILES)


def unlisted(directory: Path) -> list[str]:
    """Entries under ``directory`` that no qerl command owns there (sorted; a directory's own entries folded into
    it): not in its manifest, or, without one, not a known model file. Links are never owned."""
    directory = Path(directory)
    if not directory.is_dir() or directory.is_symlink():
        return []
    manifest = read(directory)
    listed = set(manifest["files"]) if manifest else None
    parents = {str(Path(f).parent.as_posix()) for f in listed or ()}
    bad = []
    for rel, p in _entries(directory):
        if any(rel.startswith(b + "/") for b in bad):
            continue
        if p.is_symlink():
            bad.append(rel)
        elif listed is None:
            if not _legacy_owned(rel, p):
                bad.append(rel)
        elif p.is_dir():
            if rel not in parents and not any(f.startswith(rel + "/") for f in listed):
                bad.append(rel)
        elif rel not in listed:
            bad.append(rel)
    return sorted(bad)


def changed(directory: Path) -> list[str]:
    """Listed files that are missing or differ from the manifest (size, and sha256 where recorded: every file of a
    manifest written since weights were hashed too); without a manifest, ``["qerl_files.json"]`` (nothing to check
    against)."""
    directory = Path(directory)
    manifest = read(directory)
    if manifest is None:
        return [MANIFEST]
    out = []
    for rel, rec in manifest["files"].items():
        p = directory / rel
        if not p.is_file() or p.is_symlink() or p.stat().st_size != rec.get("bytes") or \
                ("sha256" in rec and _sha256(p) != rec["sha256"]):
            out.append(rel)
    return out


def modified(directory: Path) -> list[str]:
    """:func:`changed` for an output about to be taken as done: a directory written before manifests existed has
    nothing to check against and counts as unchanged."""
    return [] if read(directory) is None else changed(directory)


def check_replaceable(directory: Path, flag: str = "--output", how: str = "--force") -> None:
    """Raise :class:`NotOwned` (one line) when ``directory`` holds anything ``how`` must not remove."""
    directory = Path(directory)
    if directory.is_symlink():
        raise NotOwned(f"{flag} {directory}: is a symbolic link (to {os.readlink(directory)}); {how} never replaces "
                       "a link's target: give the real path, or remove the link")
    bad = unlisted(directory)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise NotOwned(f"{flag} {directory}: holds {shown}, which no qerl command wrote there; {how} replaces only "
                       "what qerl wrote (listed in its qerl_files.json): move them out or choose another output")


def check_force(output: Path, force: bool, flag: str = "--output") -> None:
    """A command's ``--force`` check, before any work: without ``force`` nothing is replaced (the command refuses
    a non-empty output itself); with it, only a directory everything in which is qerl's."""
    if force and (Path(output).exists() or Path(output).is_symlink()):
        check_replaceable(Path(output), flag)
