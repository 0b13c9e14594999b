"""Fetch once, run offline (`qerl fetch`, `qerl.inputs`): the hub inputs of a config, the lock file of their
commits (the hub mocked: no network here), the cache check with the hub off, the workflow using the locked commits
with the hub off, and clear errors for a lock that lacks an input and for a cache that lacks one."""
import hashlib
import os
import sys
from pathlib import Path

import pytest
import yaml

from qerl import inputs
from qerl.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "config/paper.yaml"


def _commit(repo, rev):
    return hashlib.sha1(f"{repo}@{rev}".encode()).hexdigest()


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """snapshot_download -> <cache>/<repo>/snapshots/<commit> (files only with a network; ``local_files_only``
    finds what was fetched); datasets.load_dataset records its calls."""
    import datasets
    import huggingface_hub

    cache, calls, fetched = tmp_path / "hub", [], set()

    def snapshot_download(repo, revision=None, repo_type=None, allow_patterns=None, local_files_only=False,
                          local_dir=None):
        commit = revision if revision and len(revision) == 40 else _commit(repo, revision)
        if local_files_only and (repo, commit) not in fetched:
            raise FileNotFoundError(f"{repo}@{commit} not cached")
        fetched.add((repo, commit))
        d = cache / repo.replace("/", "--") / "snapshots" / commit
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text("{}")
        return str(d)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)))
    return calls


def test_fetch_writes_the_lock_and_check_finds_the_cache(tmp_path, fake_hub, capsys):
    lock_path = tmp_path / "paper.lock.yaml"
    assert main(["fetch", "--configfile", str(PAPER), "--dry-run"]) == 0
    listed = capsys.readouterr().out
    assert "model qwen2.5-32b: Qwen/Qwen2.5-32B-Instruct@main" in listed
    assert "dataset aime25: yentinglin/aime_2025@main" in listed
    assert main(["fetch", "--configfile", str(PAPER), "--lock", str(lock_path)]) == 0
    lock = yaml.safe_load(lock_path.read_text())
    assert set(lock["models"]) == {"qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b"}
    assert set(lock["datasets"]) == {"gsm8k", "gsm8k_test", "bigmath_l345", "bigmath_l45", "math500", "aime24",
                                     "aime25", "amc23"}
    assert lock["models"]["qwen2.5-7b"] == {"repo": "Qwen/Qwen2.5-7B-Instruct", "revision": "main",
                                            "commit": _commit("Qwen/Qwen2.5-7B-Instruct", "main")}
    # datasets are prepared at the locked commit (their cache filled for offline loading)
    assert (("openai/gsm8k", "main"), {"split": "test", "revision": _commit("openai/gsm8k", "main")}) in fake_hub
    assert main(["fetch", "--configfile", str(PAPER), "--lock", str(lock_path), "--check"]) == 0
    assert "all 12 hub inputs" in capsys.readouterr().out
    # another machine's lock: an input it has not fetched is named, with the command to run
    other = yaml.safe_load(lock_path.read_text())
    other["models"]["qwen2.5-3b"]["commit"] = "0" * 40
    lock_path.write_text(yaml.safe_dump(other))
    assert main(["fetch", "--configfile", str(PAPER), "--lock", str(lock_path), "--check"]) == 2
    err = capsys.readouterr().err
    assert "1 of 12 locked inputs are missing here: model qwen2.5-3b (Qwen/Qwen2.5-3B-Instruct@000000000000)" in err
    assert f"qerl fetch --configfile {PAPER}" in err


def test_a_lock_that_disagrees_with_the_config_is_named():
    config = yaml.safe_load(PAPER.read_text())
    c = "a" * 40
    lock = {"models": {n: {"repo": m["hub_id"], "revision": "main", "commit": c} for n, m in config["models"].items()},
            "datasets": {}}
    with pytest.raises(inputs.InputsError, match=r"dataset gsm8k \(openai/gsm8k@main\) is not in the lock"):
        inputs.locked_commits(config, lock)
    lock["models"]["qwen2.5-7b"]["repo"] = "Qwen/Qwen2.5-7B"
    with pytest.raises(inputs.InputsError, match="model qwen2.5-7b is locked as Qwen/Qwen2.5-7B@main"):
        inputs.locked_commits(config, lock)


def test_the_workflow_runs_the_locked_commits_with_the_hub_off(tmp_path, fake_hub):
    """paper.yaml + `inputs_lock`: the download jobs ask for the locked commits, the hub benchmarks' evaluations
    pass them as --revision, the training sets' revision is the commit, and every job exports HF_HUB_OFFLINE."""
    import subprocess

    lock_path = tmp_path / "paper.lock.yaml"
    assert main(["fetch", "--configfile", str(PAPER), "--lock", str(lock_path)]) == 0
    over = tmp_path / "lock.yaml"
    over.write_text(f"inputs_lock: {lock_path}\n")
    env = {**os.environ, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [str(Path(sys.executable).parent / "snakemake"), "--snakefile", str(ROOT / "Snakefile"), "--configfile",
           str(PAPER), str(PAPER.parent / "resources/gpus8.yaml"), str(over), "--cores", "4", "--directory", str(tmp_path), "-n", "-p"]
    out = subprocess.run(cmd + ["--forcerun", "download_model", "evaluate_trained"], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    c7 = _commit("Qwen/Qwen2.5-7B-Instruct", "main")
    assert f"qerl download --model Qwen/Qwen2.5-7B-Instruct --revision {c7}" in out.stdout
    assert f"--benchmark aime25 --revision {_commit('yentinglin/aime_2025', 'main')}" in out.stdout
    # each job's MLflow run records the revisions it read
    assert f"--mlflow-tag model_revision={c7}" in out.stdout
    assert f"--mlflow-tag benchmark_revision={_commit('yentinglin/aime_2025', 'main')}" in out.stdout
    from qerl import workflow_config as wc

    config = wc._merge(yaml.safe_load(PAPER.read_text()), {"inputs_lock": str(lock_path)})
    wc.apply_lock(config)
    assert config["datasets"]["gsm8k"]["revision"] == _commit("openai/gsm8k", "main")
    smk = (ROOT / "workflow/rules/common.smk").read_text()
    assert 'export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1; " if config.get("inputs_lock")' in smk
    # a lock without an input stops the workflow before any job, naming it
    lock = yaml.safe_load(lock_path.read_text())
    del lock["datasets"]["amc23"]
    lock_path.write_text(yaml.safe_dump(lock))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "dataset amc23 (math-ai/amc23@main) is not in the lock" in out.stdout + out.stderr


def test_offline_download_links_the_cached_snapshot_and_names_a_missing_one(tmp_path, fake_hub, monkeypatch):
    from qerl.checkpoint import CheckpointError
    from qerl.data.tasks import DataError, load_hub
    from qerl.models.source import download

    import huggingface_hub

    huggingface_hub.snapshot_download("Qwen/Qwen2.5-3B-Instruct", revision="main")  # "fetched" earlier
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = download("Qwen/Qwen2.5-3B-Instruct", "main", tmp_path / "m")
    assert (out / "config.json").is_symlink() and (out / "config.json").read_text() == "{}"
    with pytest.raises(CheckpointError, match="'Qwen/Qwen2.5-7B-Instruct' at revision main is not in this machine's "
                                              "Hugging Face cache and the hub is off.*qerl fetch --configfile"):
        download("Qwen/Qwen2.5-7B-Instruct", "main", tmp_path / "m7")

    import datasets

    def offline(*a, **k):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"gsm8k \(openai/gsm8k@abc\) is not in this machine's cache and the hub is "
                                        r"off: run `qerl fetch"):
        load_hub("gsm8k", "abc")


def test_a_lock_with_a_key_given_twice_is_named(tmp_path):
    """A lock file is read like every other YAML input: a key given twice is refused, naming the file and lines
    (yaml.safe_load would keep the last entry without a word)."""
    entry = "{repo: r/m, revision: main, commit: " + "a" * 40 + "}"
    lock = tmp_path / "lock.yaml"
    lock.write_text(f"models:\n  m: {entry}\n  m: {entry}\ndatasets: {{}}\n")
    with pytest.raises(inputs.InputsError, match=r"lock.yaml: key 'm' is given twice \(lines 2 and 3\)"):
        inputs.read_lock(lock)
    lock.write_text(f"models:\n  m: {entry}\ndatasets: {{}}\n")
    assert inputs.read_lock(lock)["models"]["m"]["commit"] == "a" * 40
