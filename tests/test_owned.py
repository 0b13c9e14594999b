"""Ownership in one place (qerl.owned): what --force / --overwrite may remove is what a qerl command wrote (its
manifest, qerl_files.json), never a user's file, a nested directory or a link's target; an output whose files no
longer match their manifest is never taken as done."""
import json
import os
import subprocess
import sys

import pytest

from qerl import owned


def qerl(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "qerl", *map(str, args)], capture_output=True, text=True, cwd=cwd)


def snapshot(root):
    """Every file under root with its bytes (links as their target text)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            if os.path.islink(p):
                out[p] = ("link", os.readlink(p))
            elif os.path.isfile(p):
                out[p] = open(p, "rb").read()
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("owned")
    r = qerl("build-tiny", "--output", d / "model")
    assert r.returncode == 0, r.stderr
    return d / "model"


def test_a_written_model_lists_its_files_and_a_force_replaces_only_them(tiny, tmp_path):
    manifest = json.loads((tiny / "qerl_files.json").read_text())
    assert manifest["written_by"] == "qerl" and "config.json" in manifest["files"]
    assert set(manifest["files"]) == {p.name for p in tiny.iterdir()} - {"qerl_files.json"}
    assert owned.unlisted(tiny) == [] and owned.changed(tiny) == []
    model = tmp_path / "m"
    assert qerl("build-tiny", "--output", model).returncode == 0
    (model / "config.json").unlink()  # what snakemake does to a rerun job's declared outputs
    r = qerl("build-tiny", "--output", model, "--force")
    assert r.returncode == 0, r.stderr
    assert (model / "config.json").is_file() and owned.changed(model) == []


@pytest.mark.parametrize("extra", ["notes", "nested", "link"])
def test_force_refuses_anything_it_did_not_write_before_deleting_anything(tmp_path, extra):
    model = tmp_path / "m"
    assert qerl("build-tiny", "--output", model).returncode == 0
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    if extra == "notes":
        (model / "notes.txt").write_text("mine")
        name = "notes.txt"
    elif extra == "nested":  # another model (an NVFP4 checkpoint) kept inside the model directory
        assert qerl("build-tiny", "--output", model / "nvfp4").returncode == 0
        name = "nvfp4"
    else:
        os.symlink(target, model / "data")
        name = "data"
    before = snapshot(tmp_path)
    r = qerl("build-tiny", "--output", model, "--force")  # (quantize / from-gguf / export-merged: test_bad_inputs)
    assert r.returncode == 2 and f"holds {name}, which no qerl command wrote there" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert snapshot(tmp_path) == before


def test_an_output_path_that_is_a_link_is_never_replaced(tmp_path):
    real = tmp_path / "real"
    assert qerl("build-tiny", "--output", real).returncode == 0
    os.symlink(real, tmp_path / "alias")
    before = snapshot(tmp_path)
    r = qerl("build-tiny", "--output", tmp_path / "alias", "--force")
    assert r.returncode == 2 and "is a symbolic link" in r.stderr and "Traceback" not in r.stderr
    assert snapshot(tmp_path) == before


def test_a_directory_of_an_older_qerl_is_replaceable_only_when_it_holds_model_files(tmp_path):
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "qerl_tiny.json"):
        (legacy / name).write_text("{}")
    assert owned.unlisted(legacy) == [] and owned.changed(legacy) == ["qerl_files.json"]
    (legacy / "notes.md").write_text("mine")
    (legacy / "sub").mkdir()
    (legacy / "sub" / "model.safetensors").write_text("x")
    assert owned.unlisted(legacy) == ["notes.md", "sub"]
    with pytest.raises(owned.NotOwned, match=r"holds notes.md, sub, which no qerl command wrote there"):
        owned.check_replaceable(legacy)


def test_a_changed_output_is_not_taken_as_done(tiny, tmp_path):
    """quantize's "up to date" reads the manifest: a weights file cut short is found, and --force rewrites it."""
    q = tmp_path / "q"
    assert qerl("quantize", "--model", tiny, "--output", q).returncode == 0
    again = qerl("quantize", "--model", tiny, "--output", q)
    assert again.returncode == 0 and "already quantized from this source; nothing to do" in again.stdout
    weights = next(q.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    assert owned.changed(q) == [weights.name]
    r = qerl("quantize", "--model", tiny, "--output", q)
    assert r.returncode == 2 and f"{weights.name} no longer match what was written" in r.stderr
    assert qerl("quantize", "--model", tiny, "--output", q, "--force").returncode == 0
    assert owned.changed(q) == [] and weights.read_bytes() == data


def test_a_bad_manifest_is_named(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "qerl_files.json").write_text("{not json")
    with pytest.raises(owned.NotOwned, match="qerl_files.json: not a qerl manifest"):
        owned.unlisted(d)


def test_overwrite_never_follows_a_link_nor_deletes_what_train_did_not_write(tmp_path):
    """train --overwrite: a final/ that is a link to someone's directory, or a file of theirs inside checkpoint/,
    stops it before any file of the run is deleted."""
    from qerl.train.ownership import OwnershipError, prepare

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"method": "qerl", "algorithm": {"name": "grpo"},
                                                 "output_dir": str(run)}))  # (qerl train writes it first)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.1}) + "\n")
    (run / "summary.json").write_text(json.dumps({"method": "qerl", "steps": 1}))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "adapter_config.json").write_text("{}")
    os.symlink(theirs, run / "final")
    before = snapshot(tmp_path)
    with pytest.raises(OwnershipError, match=r"final \(a symbolic link to .*theirs\), which qerl train did not write; "
                                             "nothing was deleted"):
        prepare(run, "overwrite")
    assert snapshot(tmp_path) == before
    (run / "final").unlink()
    ckpt = run / "checkpoint"
    ckpt.mkdir()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1}))
    (ckpt / "important.txt").write_text("mine")
    with pytest.raises(OwnershipError, match="checkpoint/important.txt"):
        prepare(run, "overwrite")
    assert (run / "metrics.jsonl").exists() and (ckpt / "important.txt").read_text() == "mine"
    (ckpt / "important.txt").unlink()
    assert prepare(run, "overwrite") is False
    assert not (run / "metrics.jsonl").exists() and not ckpt.exists() and theirs.is_dir()


def test_a_large_file_zeroed_at_the_same_size_is_changed(tmp_path):
    """issue 80: the manifest checks content, not only size, for every file it lists (weights over 1 MiB too)."""
    from qerl import owned

    d = tmp_path / "out"
    d.mkdir()
    (d / "model.safetensors").write_bytes(bytes(range(256)) * 8192)  # 2 MiB
    owned.write(d, "test")
    assert owned.changed(d) == []
    (d / "model.safetensors").write_bytes(bytes(2 * 1024 * 1024))  # the same size, zeroed
    assert owned.changed(d) == ["model.safetensors"]
