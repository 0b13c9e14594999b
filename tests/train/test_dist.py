"""Data-parallel `qerl train` (torchrun, gloo on CPU): a two-process run gives the one-process metrics; a
killed rank stops the run with the checkpoint intact and --resume reproduces it; bad launches are refused.

Tolerance: GRPO with shares that are whole micro-batches is bit-identical (the all-reduce of two partial
gradients, scaled by 2 then averaged, is the one-process sum exactly); DAPO with uneven shares (micro-batch
boundaries differ, so the forward runs on other batch shapes) agrees to 1e-5 relative / 1e-6 absolute; the full
method with its AdamW states sharded over the ranks (ZeroRedundancyOptimizer) is bit-identical too, under FSDP2
within 1e-5."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qerl.train import dist
from qerl.train.loop import DETERMINISTIC_METRICS
from qerl.train.update import rank_micro_batches as _rank_micro_batches

ROOT = Path(__file__).resolve().parents[2]
KEYS = DETERMINISTIC_METRICS + ("grad_norm", "groups_generated", "generated_tokens")


def _config(tmp_path, model, name, **over) -> Path:
    cfg = {"method": "qerl", "output_dir": str(tmp_path / name), "steps": 4, "prompts_per_step": 4,
           "micro_batch_size": 8, "seed": 0, "checkpoint_every": 2, "device": "cpu",
           "model": {"path": str(model), "dtype": "float32"}, "data": {"task": "synthetic"},
           "rollout": {"temperature": 1.0, "max_new_tokens": 5}, "algorithm": {"name": "grpo", "group_size": 4},
           "lora": {"r": 8, "alpha": 16}, "aqn": {"sigma_start": 0.05, "sigma_end": 0.01, "stages": 1},
           "reward": {"correctness": "exact"}, "optim": {"lr": 0.003}, "tracking": {"backend": "none"}}
    for k, v in over.items():
        node = cfg
        *parents, leaf = k.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = v
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(cfg: Path, *args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qerl", "train", "--config", str(cfg), "--no-progress", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


def _rows(cfg: Path) -> list[dict]:
    out = Path(yaml.safe_load(cfg.read_text())["output_dir"])
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_same(a: list[dict], b: list[dict], rel: float = 0.0, abs_: float = 0.0):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for k in KEYS:
            if k in ra:
                assert abs(ra[k] - rb[k]) <= max(rel * abs(ra[k]), abs_), (ra["step"], k, ra[k], rb[k])


def test_shares_are_whole_groups_and_every_rank_runs_as_many_micro_batches():
    assert [list(dist.share(5, dist.Dist(r, 2))) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [list(dist.share(1, dist.Dist(r, 3))) for r in range(3)] == [[0], [], []]
    # 3 groups of 4 rows, micro-batches of 4, two ranks: rank 1 repeats one micro-batch with weight 0
    m0 = _rank_micro_batches(12, 4, 4, dist.Dist(0, 2))
    m1 = _rank_micro_batches(12, 4, 4, dist.Dist(1, 2))
    assert m0 == [(slice(0, 4), True), (slice(4, 8), True)]
    assert m1 == [(slice(8, 12), True), (slice(8, 12), False)]
    assert _rank_micro_batches(4, 4, 8, dist.Dist(1, 2)) == [(slice(0, 4), False)]  # no group: a filler only


def test_micro_batches_by_length_sort_within_groups_and_keep_sizes_rows_and_fillers():
    import torch

    from qerl.train.update import by_length, in_row_order

    lengths = [3, 9, 1, 9, 5, 0, 7, 2]  # two groups of 4
    cmask = torch.tensor([[1] * n + [0] * (9 - n) for n in lengths])
    micro = [(slice(0, 2), True), (slice(2, 4), True), (slice(4, 6), True), (slice(6, 8), True),
             (slice(6, 8), False)]
    out = by_length(micro, cmask, 4)
    assert [m.tolist() for m, _ in out[:4]] == [[1, 3], [0, 2], [6, 4], [7, 5]]  # longest first, ties in row order
    assert out[4] == (slice(6, 8), False)
    vals = [(m, cmask[m].sum(1, keepdim=True)) for m, _ in out[:4]]
    assert in_row_order(vals).flatten().tolist() == lengths  # back in row order
    # a rank owning the second group gets the same micro-batches as one process does for it
    assert [m.tolist() for m, _ in by_length([(slice(4, 6), True), (slice(6, 8), True)], cmask, 4)] == [[6, 4], [7, 5]]
    assert by_length(micro, cmask, 1) == micro  # no groups: nothing to sort


def test_two_processes_equal_one_and_a_killed_rank_resumes(warm_model, tmp_path):
    one, two = _config(tmp_path, warm_model, "one"), _config(tmp_path, warm_model, "two")
    for cfg, n in ((one, "1"), (two, "2")):
        r = _train(cfg, "--nproc", n)
        assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("done: metrics") == 1  # rank 0 alone reports (and writes)
    _assert_same(_rows(one), _rows(two))
    idle = [row["rank_idle_seconds"] for row in _rows(two)]
    assert all(v >= 0 for v in idle) and all(row["rank_idle_seconds"] == 0 for row in _rows(one))

    # rank 1 is killed (SIGKILL) as step 3 starts: torchrun stops rank 0, the step-2 checkpoint is intact
    kill = _config(tmp_path, warm_model, "kill")
    r = _train(kill, "--nproc", "2", env={"QERL_FAULT_KILL": "1:3"})
    assert r.returncode != 0
    state = json.loads((tmp_path / "kill" / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["world_size"] == 2 and len(_rows(kill)) == 2
    r = _train(kill, "--resume")  # another world size: refused, nothing touched
    assert r.returncode == 2 and "written by a run on 2 process(es); this one has 1" in r.stderr
    assert len(_rows(kill)) == 2
    r = _train(kill, "--resume", "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same(_rows(two), _rows(kill))


def test_dapo_with_uneven_shares_equals_one_process(warm_model, tmp_path):
    """DAPO's filter without refills keeps 2-4 groups per step: shares of 1-2 groups, micro-batches of one group,
    so a rank pads its micro-batches with weight-0 repeats; the kept groups and metrics match one process."""
    over = {"algorithm.name": "dapo", "algorithm.max_refill_rounds": 0, "micro_batch_size": 4, "steps": 5}
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    one = _config(tmp_path, warm_model, "one", **over)
    two = _config(tmp_path, warm_model, "two", **over, tracking={"backend": "mlflow", "tracking_uri": uri,
                                                                 "experiment": "dp"})
    for cfg, n in ((one, "1"), (two, "2")):
        r = _train(cfg, "--nproc", n)
        assert r.returncode == 0, r.stderr[-3000:]
    assert any(row["groups_kept"] % 2 for row in _rows(one))  # an odd number of groups: uneven shares happened
    _assert_same(_rows(one), _rows(two), rel=1e-5, abs_=1e-6)
    mlflow = pytest.importorskip("mlflow")
    client = mlflow.tracking.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("dp").experiment_id])  # rank 0 alone logs
    assert len(client.get_metric_history(run.info.run_id, "reward_mean")) == 5


def test_bad_launches_are_refused(warm_model, tmp_path):
    cfg = _config(tmp_path, warm_model, "bad")
    r = _train(cfg, "--nproc", "3")
    assert r.returncode == 2 and "prompts_per_step = 4 does not split over 3 processes" in r.stderr
    assert not (tmp_path / "bad").exists()  # refused before any process started
    r = _train(cfg, "--nproc", "2", "--dry-run")
    assert r.returncode == 0 and "torch.distributed.run --standalone --nproc-per-node=2 -m qerl train" in r.stdout
    assert "--nproc" not in r.stdout.split("qerl train", 1)[1]
    r = _train(cfg, "--nproc", "4", "--nnodes", "2", "--dry-run", "--set", "prompts_per_step=8")
    assert r.returncode == 0
    line = r.stdout.strip()
    assert line.startswith("srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 --kill-on-bad-exit=1 bash -c")
    assert "--nnodes=2 --nproc-per-node=4 --rdzv-backend=c10d" in line and "$SLURM_JOB_ID" in line
    assert "--set prompts_per_step=8" in line and "--nnodes 2" not in line
    r = _train(cfg, "--nproc", "4", "--nnodes", "2", "--set", "prompts_per_step=8")  # not inside an allocation
    assert r.returncode == 2 and "inside an allocation" in r.stderr


def test_ranks_with_other_configs_or_weights_are_refused(monkeypatch):
    from qerl.errors import TrainingError

    d = dist.Dist(0, 2)
    monkeypatch.setattr(dist, "gather", lambda d, obj, what: [obj, "0123456789abcdef"])
    with pytest.raises(TrainingError, match="different configurations.*rank 1 0123456789abcdef"):
        dist.check_same_config(d, {"seed": 0})
    import torch

    monkeypatch.setattr(dist, "gather", lambda d, obj, what: [obj, [x + 1 for x in obj]])
    with pytest.raises(TrainingError, match=r"ranks \[1\] start from other trainable weights"):
        dist.check_same_weights(d, torch.nn.Linear(2, 2))


def test_a_stalled_rank_stops_the_run_within_the_timeout(warm_model, tmp_path):
    """Rank 1 stalls as step 3 starts: rank 0's next collective times out (QERL_DIST_TIMEOUT) with a message
    naming the step, torchrun stops rank 1, and the step-2 checkpoint is intact."""
    cfg = _config(tmp_path, warm_model, "hang")
    r = _train(cfg, "--nproc", "2", env={"QERL_FAULT_HANG": "1:3", "QERL_DIST_TIMEOUT": "10"})
    assert r.returncode != 0
    assert "rank 0 of 2: another rank stopped or stalled while gathering the rollouts of step 3" in r.stderr
    assert "rerun with --resume --nproc 2" in r.stderr
    assert json.loads((tmp_path / "hang" / "checkpoint" / "trainer_state.json").read_text())["step"] == 2


@pytest.mark.parametrize("sharding, note, tol", [
    ("auto", "ZeroRedundancyOptimizer, sharding: optimizer): rank 0 keeps those of ", 0.0),
    ("fsdp", "FSDP2, sharding: fsdp): rank 0 holds ", 1e-5),
])
def test_full_method_sharded_equals_one_process_and_resumes(warm_model, tmp_path, sharding, note, tol):
    """The full method under two processes. auto = DDP gradients + ZeroRedundancyOptimizer (each rank holds half
    of the AdamW states): bit-identical to one process. fsdp = FSDP2 (weights, gradients and states sharded; the
    lm_head whole, its gradient all-reduced): within 1e-5 (reduce-scatter and the split norm sum in another
    order). Checkpoints gather everything on rank 0; a run killed at step 3 resumes to the uninterrupted
    metrics; a checkpoint of the other sharding is refused."""
    over = {"method": "full", "optim.lr": 0.0005, "sharding": sharding}
    one, two, kill = (_config(tmp_path, warm_model, n, **over) for n in ("one", "two", "kill"))
    for cfg, n in ((one, "1"), (two, "2")):
        r = _train(cfg, "--nproc", n)
        assert r.returncode == 0, r.stderr[-3000:]
    kept, total = (int(v.replace(",", "")) for v in r.stdout.split(note)[1].split(" parameters")[0].split(" of "))
    assert 0.3 < kept / total < 0.7 if sharding == "auto" else 0.5 < kept / total < 0.8  # (fsdp: + the lm_head)
    _assert_same(_rows(one), _rows(two), rel=tol, abs_=tol / 10)
    import torch
    from safetensors.torch import load_file

    ckpt = tmp_path / "two" / "checkpoint"
    blob = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    if sharding == "fsdp":  # each rank's shards, written by that rank (torch.distributed.checkpoint)
        assert blob["optimizer"] is None and len(list((ckpt / "dcp").glob("*.distcp"))) == 2
        assert (ckpt / "dcp" / ".metadata").exists() and not list((tmp_path / "two").glob(".checkpoint.dcp-*"))
    else:  # ZeRO-1: consolidated on rank 0
        assert len(blob["optimizer"]["state"]) == sum(len(g["params"]) for g in blob["optimizer"]["param_groups"])
    final = load_file(next((tmp_path / "two" / "final").glob("*.safetensors")))
    ref = load_file(next((tmp_path / "one" / "final").glob("*.safetensors")))
    assert final.keys() == ref.keys() and all(torch.allclose(final[k], ref[k], rtol=1e-4, atol=1e-6) for k in ref)
    r = _train(kill, "--nproc", "2", env={"QERL_FAULT_KILL": "1:3"})
    assert r.returncode != 0
    other = "none" if sharding == "fsdp" else "fsdp"
    r = _train(kill, "--resume", "--nproc", "2", "--set", f"sharding={other}")
    assert r.returncode != 0 and "resume with the same `sharding`" in r.stderr + r.stdout
    r = _train(kill, "--resume", "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same(_rows(two), _rows(kill), rel=tol, abs_=tol / 10)


def test_fsdp_with_tied_embeddings_dapo_and_checkpointing(tmp_path):
    """FSDP2 where the lm_head is the embedding matrix (Qwen2.5-3B ties them: both stay whole, one all-reduced
    gradient), DAPO keeping an odd number of groups (ranks run filler micro-batches in lockstep, FSDP's forwards
    being collectives) and gradient checkpointing: the one-process metrics within 1e-6."""
    from qerl.data.tasks import synthetic_arithmetic
    from qerl.models.tiny import TinySpec, save_tiny_model
    from qerl.train.sft import sft

    base = save_tiny_model(tmp_path / "base", TinySpec(seed=0, tie_word_embeddings=True))
    sft(base, tmp_path / "sft", synthetic_arithmetic(2000, seed=0), steps=80, progress=False)
    model = tmp_path / "sft"
    over = {"method": "full", "optim.lr": 0.0005, "sharding": "fsdp", "gradient_checkpointing": True,
            "algorithm.name": "dapo", "algorithm.max_refill_rounds": 0, "micro_batch_size": 4}
    one, two = (_config(tmp_path, model, n, **over) for n in ("one", "two"))
    for cfg, n in ((one, "1"), (two, "2")):
        r = _train(cfg, "--nproc", n)
        assert r.returncode == 0, r.stderr[-3000:]
    assert "FSDP2" in r.stdout and any(row["groups_kept"] % 2 for row in _rows(one))
    _assert_same(_rows(one), _rows(two), rel=1e-6, abs_=1e-7)


@pytest.mark.parametrize("nproc, sharding, tol", [("1", "auto", 0.0), ("2", "fsdp", 1e-5)])
def test_parked_states_train_exactly_as_kept_ones(warm_model, tmp_path, nproc, sharding, tol):
    """The full method with its AdamW states parked during every rollout gives the metrics of the same run with
    them kept (one process: bit-identical; FSDP2 over two processes: against one process, as without parking)."""
    over = {"method": "full", "optim.lr": 0.0005, "sharding": sharding}
    kept = _config(tmp_path, warm_model, "kept", **over)
    parked = _config(tmp_path, warm_model, "parked", **over, **{"optim.offload": "rollout"})
    assert _train(kept, "--nproc", "1").returncode == 0
    r = _train(parked, "--nproc", nproc, env={"QERL_OFFLOAD_ON_CPU": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "optimizer states parked in host memory" in r.stdout
    rows = _rows(parked)
    assert rows[0]["offload_gb"] == 0 and all(row["offload_gb"] > 0 for row in rows[1:])  # none before step 1
    _assert_same(_rows(kept), rows, rel=tol, abs_=tol / 10)


def test_packed_sequences_two_processes_equal_one_and_the_padded_run(warm_model, tmp_path):
    """`packed_sequences: true` under torchrun (each rank packs its own micro-batches; DDP carries the packing to the
    scorer) equals the one-process packed run, and the padded run to fp32 rounding (CPU: the per-sequence reference
    attention). With ``micro_batch_tokens`` (micro-batches of a few rows, cut per rank by tokens, the ranks in step
    through weight-0 fillers) two processes equal the one-micro-batch run to fp32 rounding too."""
    one = _config(tmp_path, warm_model, "p1", packed_sequences=True, steps=2, checkpoint_every=2)
    two = _config(tmp_path, warm_model, "p2", packed_sequences=True, steps=2, checkpoint_every=2)
    pad = _config(tmp_path, warm_model, "pad", steps=2, checkpoint_every=2)
    tok = _config(tmp_path, warm_model, "tok", packed_sequences=True, steps=2, checkpoint_every=2,
                  micro_batch_tokens=40)
    for cfg, n in ((one, "1"), (two, "2"), (pad, "1"), (tok, "2")):
        r = _train(cfg, "--nproc", n)
        assert r.returncode == 0, r.stderr[-3000:]
    assert "micro_batch_tokens 40" in r.stdout
    _assert_same(_rows(one), _rows(two))
    _assert_same(_rows(one), _rows(pad), rel=1e-4, abs_=1e-6)
    _assert_same(_rows(one), _rows(tok), rel=1e-4, abs_=1e-6)
