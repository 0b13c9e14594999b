"""qerl.gpu_claim: workflow jobs of a local multi-GPU run each on their own GPUs (flock per GPU, held until the
process exits), and the Snakefile wiring it up."""
import os
import signal
import subprocess
import sys
import time

import pytest

from qerl import gpu_claim


@pytest.fixture(autouse=True)
def _release():
    yield
    gpu_claim.release()


def test_jobs_claim_distinct_gpus_and_wait_when_none_is_free(tmp_path):
    ids = ["0", "1", "2"]
    assert gpu_claim.claim(2, tmp_path, ids) == ["0", "1"]
    assert gpu_claim.claim(1, tmp_path, ids) == ["2"]  # (flock: another open file conflicts in one process too)
    with pytest.raises(RuntimeError, match=r"no 1 free GPU\(s\) of 0,1,2 after"):
        gpu_claim.claim(1, tmp_path, ids, timeout_s=0.3, poll_s=0.1)
    with pytest.raises(RuntimeError, match=r"asks for 4 GPU\(s\); 3 visible"):
        gpu_claim.claim(4, tmp_path, ids)
    gpu_claim.release()
    assert gpu_claim.claim(3, tmp_path, ids) == ids


def test_a_killed_job_leaves_its_gpus_free(tmp_path):
    """The kernel drops a process's flocks on any exit: a job killed with SIGKILL needs no cleanup."""
    code = ("import sys, time; from pathlib import Path; from qerl import gpu_claim; "
            f"print(gpu_claim.claim(2, Path({str(tmp_path)!r}), ['0', '1']), flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "['0', '1']"
    with pytest.raises(RuntimeError):
        gpu_claim.claim(1, tmp_path, ["0", "1"], timeout_s=0.2, poll_s=0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert gpu_claim.claim(2, tmp_path, ["0", "1"], timeout_s=5) == ["0", "1"]  # (a held GPU would raise at 5 s)


def test_the_cli_hook_narrows_cuda_visible_devices_once(tmp_path, monkeypatch):
    """QERL_GPU_LOCKS + QERL_CLAIM_GPUS (set by the Snakefile and the rule): the job's GPUs become its
    CUDA_VISIBLE_DEVICES; the processes it starts (torchrun's workers) do not claim again."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,7")
    monkeypatch.setenv("QERL_GPU_LOCKS", str(tmp_path))
    monkeypatch.setenv("QERL_CLAIM_GPUS", "0")
    assert gpu_claim.claim_from_env() is None  # a job without GPUs
    gpu_claim.claim(1, tmp_path, ["3"])  # another job holds GPU 3
    monkeypatch.setenv("QERL_CLAIM_GPUS", "2")
    assert gpu_claim.claim_from_env() == ["5", "7"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7" and os.environ["QERL_CLAIM_GPUS"] == "0"
    monkeypatch.setenv("QERL_CLAIM_GPUS", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert gpu_claim.claim_from_env() is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu3.lock", "gpu5.lock", "gpu7.lock"]


def test_jobs_share_a_gpu_up_to_jobs_per_gpu_spread_over_the_gpus_first(tmp_path, monkeypatch):
    """`resources.jobs_per_gpu: N` (QERL_JOBS_PER_GPU): N jobs may hold a slot of one GPU; slot 0 of every GPU fills
    before any GPU takes a second job, so jobs spread before they share."""
    ids = ["0", "1"]
    got = [gpu_claim.claim(1, tmp_path, ids, slots=2)[0] for _ in range(4)]
    assert got == ["0", "1", "0", "1"]
    with pytest.raises(RuntimeError, match="no 1 free GPU"):
        gpu_claim.claim(1, tmp_path, ids, slots=2, timeout_s=0.2, poll_s=0.05)
    gpu_claim.release()
    assert gpu_claim.claim(2, tmp_path, ids, slots=2) == ["0", "1"]  # a 2-GPU job takes one slot on each
    gpu_claim.release()
    monkeypatch.setenv("QERL_JOBS_PER_GPU", "3")
    assert gpu_claim.jobs_per_gpu() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("QERL_JOBS_PER_GPU", bad)
        with pytest.raises(RuntimeError, match="QERL_JOBS_PER_GPU"):
            gpu_claim.jobs_per_gpu()
