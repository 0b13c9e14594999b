"""``qerl train`` end to end on a tiny warm-started model: every method, DAPO, KL, AQN wiring,
metrics, checkpoints, exact resume after a kill, NaN guard, MLflow, and a learning test."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qerl.tracking import NullTracker
from qerl.train.config import from_dict, validate, TrainConfig
from qerl.train.loop import DETERMINISTIC_METRICS, train

ROOT = Path(__file__).resolve().parents[2]
BASE = {
    "steps": 4, "prompts_per_step": 4, "micro_batch_size": 16, "checkpoint_every": 2, "device": "cpu",
    "model": {"dtype": "float32"}, "data": {"task": "synthetic"},
    "rollout": {"temperature": 1.0, "max_new_tokens": 5},
    "algorithm": {"name": "grpo", "group_size": 4}, "lora": {"r": 8, "alpha": 16},
    "aqn": {"sigma_start": 0.05, "sigma_end": 0.01, "stages": 1},
    "reward": {"correctness": "exact"}, "optim": {"lr": 0.003}, "tracking": {"backend": "none"},
}


def make_cfg(model, out, **over):
    import copy

    d = copy.deepcopy(BASE)
    d["model"]["path"] = str(model)
    d["output_dir"] = str(out)
    for k, v in over.items():
        node = d
        *parents, leaf = k.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return validate(from_dict(TrainConfig, d))


def rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


REQUIRED = {"reward_mean", "reward_std", "accuracy", "entropy", "rollout_entropy", "kl", "clip_frac", "mismatch_kl",
            "is_ratio_mean", "response_len_mean", "response_len_max", "truncated_frac", "sigma", "lr",
            "rollout_seconds", "train_seconds", "tokens_per_second", "peak_memory_gb", "loss", "grad_norm"}


@pytest.mark.parametrize("method", ["full", "lora", "qlora", "nvfp4_lora", "qerl"])
def test_every_method_trains(method, warm_model, tmp_path):
    if method == "qlora":
        pytest.importorskip("bitsandbytes")
    out = train(make_cfg(warm_model, tmp_path / method, method=method), tracker=NullTracker(), progress=False)
    m = rows(out)
    assert [r["step"] for r in m] == [1, 2, 3, 4]
    assert REQUIRED <= set(m[0])
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in m)
    # the rollout policy's entropy (Monte Carlo over the sampled tokens) estimates what the trainer computes
    # exactly on the same tokens where no noise is drawn (the first two steps: sigma 0)
    for r in m[:2]:
        assert r["rollout_entropy"] > 0 and abs(r["rollout_entropy"] - r["entropy"]) < 0.5 * r["entropy"], r
    final = out / "final"
    if method == "full":
        assert (final / "model.safetensors").exists()
    else:
        assert (final / "adapter_config.json").exists() and (final / "adapter_model.safetensors").exists()
    assert (out / "checkpoint" / "trainer_state.json").exists()
    # AQN: the schedule ran (stage 0 then σ_start) and only qerl rollouts were noisy
    sig = [r["sigma"] for r in m]
    assert sig == ([0.0, 0.0, 0.05, 0.05] if method == "qerl" else [0.0] * 4)
    noisy = [r["mismatch_kl"] > 1e-6 for r in m]  # without noise: float round-off only (~1e-14)
    assert noisy == ([False, False, True, True] if method == "qerl" else [False] * 4)


def test_nvfp4_base_stays_bit_identical_through_training(warm_model, tmp_path):
    from qerl.train import methods

    seen = {}
    real = methods.build_policy

    def spy(*args):
        model, tok = real(*args)
        seen["model"] = model
        seen["before"] = {k: v.clone() for k, v in model.state_dict().items() if "weight_packed" in k}
        return model, tok

    import qerl.train.loop as loop

    loop.build_policy = spy
    try:
        train(make_cfg(warm_model, tmp_path / "q", method="qerl"), tracker=NullTracker(), progress=False)
    finally:
        loop.build_policy = real
    after = {k: v for k, v in seen["model"].state_dict().items() if "weight_packed" in k}
    assert seen["before"] and all(torch.equal(seen["before"][k], after[k]) for k in after)


def test_dapo_dynamic_sampling_overlong_and_kl(warm_model, tmp_path):
    out = train(make_cfg(warm_model, tmp_path / "dapo", **{"algorithm.name": "dapo", "algorithm.overlong_penalty": True,
                                                            "algorithm.overlong_cache": 2, "algorithm.max_refill_rounds": 2}),
                tracker=NullTracker(), progress=False)
    m = rows(out)
    assert all(r["groups_kept"] <= 4 for r in m)
    assert any(r["rollout_rounds"] > 1 or r["groups_kept"] == 4 for r in m)
    out = train(make_cfg(warm_model, tmp_path / "kl", method="lora", **{"algorithm.kl_coef": 0.5,
                                                                           "algorithm.updates_per_batch": 2}),
                tracker=NullTracker(), progress=False)
    m = rows(out)
    assert m[0]["kl"] == 0.0 or m[0]["kl"] < 1e-6  # before any update the adapter is zero: policy == reference
    assert any(r["kl"] > 0 for r in m[1:])
    out = train(make_cfg(warm_model, tmp_path / "dr", method="nvfp4_lora", **{"algorithm.name": "dr_grpo",
                                                                                 "algorithm.tis_cap": 2.0}),
                tracker=NullTracker(), progress=False)
    assert len(rows(out)) == 4


def test_gspo_trains_with_sequence_ratios_and_its_own_clip(warm_model, tmp_path, monkeypatch):
    """GSPO (a preset row of qerl.rl.algorithms) trains through the whole loop: its config resolves to sequence-level
    ratios under ε 3e-4 / 4e-4, the loop's loss gets those settings, the second update of a batch (μ = 2) moves the
    ratios off 1 -- one ratio per completion, the same on each of its tokens -- and the tiny ε clips whole
    completions; every row is finite."""
    from qerl.rl import losses
    from qerl.train import update

    seen = []

    def spy(logp, old, adv, mask, settings, *a, **k):
        loss, info = losses.policy_loss(logp, old, adv, mask, settings, *a, **k)
        r = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1).clamp(min=1))
        seen.append((settings, float(info["clip_frac"]), float((r - 1).abs().max())))
        return loss, info
    monkeypatch.setattr(update, "policy_loss", spy)
    out = train(make_cfg(warm_model, tmp_path / "gspo", **{"algorithm.name": "gspo", "algorithm.updates_per_batch": 2}),
                tracker=NullTracker(), progress=False)
    saved = json.loads((out / "config.json").read_text())["algorithm"]
    assert (saved["aggregation"], saved["ratio_level"], saved["clip_low"], saved["clip_high"]) == \
        ("sequence-mean", "sequence", 3e-4, 4e-4)
    assert {(s.aggregation, s.ratio_level, s.clip_low, s.clip_high) for s, _, _ in seen} == \
        {("sequence-mean", "sequence", 3e-4, 4e-4)}
    assert any(off > 4e-4 for _, _, off in seen) and any(clip > 0 for _, clip, _ in seen)
    m = rows(out)
    assert len(m) == 4 and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in m)


def test_aqn_rollout_plus_train_removes_the_mismatch(warm_model, tmp_path):
    out = train(make_cfg(warm_model, tmp_path / "rt", method="qerl", **{"aqn.apply_to": "rollout+train"}),
                tracker=NullTracker(), progress=False)
    m = rows(out)
    assert all(r["mismatch_kl"] < 1e-6 for r in m)


def test_nan_reward_stops_with_checkpoint_intact(warm_model, tmp_path, monkeypatch):
    from qerl.rewards import registry
    from qerl.train.steps import TrainingError

    out = tmp_path / "nan"
    train(make_cfg(warm_model, out, steps=2), tracker=NullTracker(), progress=False)
    state = (out / "checkpoint" / "trainer_state.json").read_text()
    monkeypatch.setattr(registry.Reward, "score", lambda self, c, g: (float("nan"), 0.0))
    with pytest.raises(TrainingError, match="non-finite reward"):
        train(make_cfg(warm_model, out, steps=4), resume=True, tracker=NullTracker(), progress=False)
    assert (out / "checkpoint" / "trainer_state.json").read_text() == state


def test_nan_loss_stops_before_the_optimizer_step(warm_model, tmp_path, monkeypatch):
    """The update loop checks its losses once, after the micro-batches are launched (it never waits for the GPU in
    between): a non-finite loss in micro-batch 2 stops the step with a message naming it, before the optimizer step,
    the checkpoint as it was."""
    from qerl.rl import losses
    from qerl.train import update
    from qerl.train.steps import TrainingError

    out = tmp_path / "nanloss"
    train(make_cfg(warm_model, out, steps=2), tracker=NullTracker(), progress=False)
    state = (out / "checkpoint" / "trainer_state.json").read_text()
    calls = []

    def nan_second(*a, **k):
        loss, info = losses.policy_loss(*a, **k)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 2 else loss), info

    monkeypatch.setattr(update, "policy_loss", nan_second)
    with pytest.raises(TrainingError, match=r"step \d+: loss is nan \(micro-batch 2 of [2-9]\); stopping"):
        train(make_cfg(warm_model, out, steps=4, micro_batch_size=2), resume=True, tracker=NullTracker(),
              progress=False)
    assert (out / "checkpoint" / "trainer_state.json").read_text() == state


class _NanGradient(torch.autograd.Function):
    """The identity forward, a NaN gradient backward: a finite loss whose gradient norm is not finite."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


def test_nonfinite_gradient_is_skipped_up_to_optim_skip_nonfinite(warm_model, tmp_path, monkeypatch):
    """A finite loss whose gradient norm is nan: by default the run stops, naming the step (1-based, as the metrics
    rows), the checkpoint intact. With ``optim.skip_nonfinite: 1`` the update is dropped as verl drops it — no
    optimizer step, the trained weights as they were —, counted in the row (``skipped_updates``, ``grad_norm`` null:
    the row stays strict JSON) and in the checkpoint, so that a resumed run's next one stops it."""
    from safetensors.torch import load_file

    from qerl.rl import losses
    from qerl.train import update
    from qerl.train.config import ConfigError
    from qerl.train.steps import TrainingError

    out = tmp_path / "nangrad"
    train(make_cfg(warm_model, out, steps=2), tracker=NullTracker(), progress=False)
    ck = out / "checkpoint"
    state, weights = (ck / "trainer_state.json").read_text(), load_file(ck / "trainable.safetensors")
    def nan_gradient(*a, **k):
        loss, info = losses.policy_loss(*a, **k)
        return _NanGradient.apply(loss), info

    monkeypatch.setattr(update, "policy_loss", nan_gradient)
    said = (r"step 3: gradient norm is nan \(non-finite in \d+ parameter\(s\) on this process, from \S+layers\.0\.\S+ "
            r"to \S+layers\.1\.\S+\); stopping \(optim.skip_nonfinite = 0: 0 ")
    with pytest.raises(TrainingError, match=said):
        train(make_cfg(warm_model, out, steps=4), resume=True, tracker=NullTracker(), progress=False)
    assert (ck / "trainer_state.json").read_text() == state

    train(make_cfg(warm_model, out, steps=3, **{"optim.skip_nonfinite": 1}), resume=True, tracker=NullTracker(),
          progress=False)
    last = rows(out)[-1]
    assert last["step"] == 3 and last["skipped_updates"] == 1 and last["grad_norm"] is None
    assert [r["skipped_updates"] for r in rows(out)[:2]] == [0, 0]
    assert json.loads((ck / "trainer_state.json").read_text())["skipped_updates"] == 1
    after = load_file(ck / "trainable.safetensors")
    assert after.keys() == weights.keys() and all(torch.equal(after[n], weights[n]) for n in weights)
    said = r"step 4: gradient norm is nan \(.*\); stopping \(optim.skip_nonfinite = 1: 1 update\(s\) of this run skipped"
    with pytest.raises(TrainingError, match=said):
        train(make_cfg(warm_model, out, steps=4, **{"optim.skip_nonfinite": 1}), resume=True, tracker=NullTracker(),
              progress=False)
    with pytest.raises(ConfigError, match=r"config.optim.skip_nonfinite: must be >= 0, got -1"):
        make_cfg(warm_model, out, **{"optim.skip_nonfinite": -1})


def _cli(cfg_path, *extra):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "qerl", "train", "--config", str(cfg_path), "--no-progress", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_killed_run_resumes_exactly(warm_model, tmp_path):
    import yaml

    def write(out):
        cfg = json.loads(json.dumps(BASE))
        cfg.update(steps=30, checkpoint_every=4, output_dir=str(out))
        cfg["model"]["path"] = str(warm_model)
        cfg["method"] = "qerl"
        cfg["aqn"]["stages"] = 3
        cfg["lora"]["dropout"] = 0.1  # exercises the saved torch RNG state
        p = tmp_path / f"{out.name}.yaml"
        p.write_text(yaml.safe_dump(cfg))
        return p

    ref_cfg, run_cfg = write(tmp_path / "ref"), write(tmp_path / "run")
    assert _cli(ref_cfg).wait(timeout=300) == 0
    proc = _cli(run_cfg)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 10:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    assert proc.wait(timeout=60) == -signal.SIGKILL, "the run finished before it could be killed"
    done = json.loads((tmp_path / "run" / "checkpoint" / "trainer_state.json").read_text())["step"]
    assert 8 <= done < 30 and done % 4 == 0
    resumed = _cli(run_cfg, "--resume")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    a, b = rows(tmp_path / "ref"), rows(tmp_path / "run")
    assert [r["step"] for r in b] == list(range(1, 31))
    for ra, rb in zip(a, b):
        assert {k: ra[k] for k in DETERMINISTIC_METRICS} == {k: rb[k] for k in DETERMINISTIC_METRICS}, ra["step"]
    from safetensors.torch import load_file

    fa, fb = (load_file(str(tmp_path / d / "final" / "adapter_model.safetensors")) for d in ("ref", "run"))
    assert all(torch.equal(fa[k], fb[k]) for k in fa)


def test_mlflow_tracking(warm_model, tmp_path):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = make_cfg(warm_model, tmp_path / "ml", steps=2, **{"tracking.backend": "mlflow", "tracking.tracking_uri": uri,
                                                           "tracking.experiment": "unit"})
    train(cfg, progress=False)
    client = mlflow.tracking.MlflowClient(uri)
    exp = client.get_experiment_by_name("unit")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == str(tmp_path / "ml") and run.data.tags["method"] == "qerl"
    assert len(client.get_metric_history(run.info.run_id, "reward_mean")) == 2
    assert run.data.params["algorithm.name"] == "grpo" and run.data.params["method"] == "qerl" and run.data.params["base_method"] == "qerl"
    assert not any(k.startswith("tracking.") for k in run.data.params)  # where it is logged is not what it is
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.json", "summary.json", "metrics.jsonl",
                                                                        "curves.png"}
    assert json.loads((tmp_path / "ml" / "summary.json").read_text())["mlflow_run_id"] == run.info.run_id


def test_run_params_leave_out_tracking_and_aqn_when_off():
    from qerl.train.tracking_setup import run_params

    conf = {"method": "lora", "optim": {"lr": 1e-4}, "aqn": {"enabled": False, "sigma_start": 0.01},
            "tracking": {"experiment": "x", "tracking_uri": "sqlite://"}}
    assert run_params(conf, {"method": "lora_r8"}) == {"method": "lora_r8", "optim.lr": 1e-4, "aqn.enabled": False,
                                                       "variant": "lora_r8", "base_method": "lora"}
    conf["aqn"]["enabled"] = "auto"  # lora's own choice: off
    assert run_params(conf, {})["aqn.enabled"] is False and "aqn.sigma_start" not in run_params(conf, {})
    conf["aqn"]["enabled"] = True
    assert run_params(conf, {})["aqn.sigma_start"] == 0.01 and run_params(conf, {})["method"] == "lora"
    assert run_params(conf, {})["variant"] == "" and run_params({**conf, "method": "qerl", "aqn": {
        "enabled": "auto", "sigma_start": 0.02}}, {})["aqn.sigma_start"] == 0.02  # qerl's auto: on


@pytest.mark.parametrize("method", ["lora", "qerl"])
def test_learning_raises_reward(method, warm_model, tmp_path):
    cfg = make_cfg(warm_model, tmp_path / method, method=method, steps=50, prompts_per_step=16, checkpoint_every=50,
                   **{"algorithm.group_size": 8, "rollout.max_new_tokens": 6, "lora.r": 16, "lora.alpha": 32,
                      "aqn.stages": 3, "optim.lr": 0.002, "micro_batch_size": 128})
    m = rows(train(cfg, tracker=NullTracker(), progress=False))
    first = sum(r["reward_mean"] for r in m[:5]) / 5
    last = sum(r["reward_mean"] for r in m[-10:]) / 10
    assert last - first >= 0.04, (first, last)


def test_gradient_checkpointing_and_8bit_adamw_switches(warm_model, tmp_path):
    out = train(make_cfg(warm_model, tmp_path / "gc", method="nvfp4_lora", steps=2, gradient_checkpointing=True,
                         **{"optim.eight_bit": "true"}), tracker=NullTracker(), progress=False)
    m = rows(out)
    assert len(m) == 2 and all(r["grad_norm"] > 0 for r in m)
    blob = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    # bitsandbytes optimizer state (tensors this small stay 32-bit inside it: min_8bit_size = 4096)
    assert all("__bnb_optimizer_quant_state__" in s for s in blob["optimizer"]["state"].values())


def test_out_of_memory_stops_with_sizes_and_resume_finishes_the_run(warm_model, tmp_path, monkeypatch):
    """An OOM in the update of step 3 (an unexpectedly long batch): a TrainingError naming the step, the phase and
    the sizes; the step-2 checkpoint intact; `--resume` then reproduces the uninterrupted run's metrics."""
    from qerl.train import loop
    from qerl.train.steps import TrainingError

    ref = rows(train(make_cfg(warm_model, tmp_path / "ref", steps=4), tracker=NullTracker(), progress=False))
    out = tmp_path / "oom"
    real, calls = loop._update, []

    def update(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(*a, **k)

    monkeypatch.setattr(loop, "_update", update)
    with pytest.raises(TrainingError, match=r"step 3: out of GPU memory in the update phase \(16 sequences, prompts "
                                            r"\d+ \+ completions \d+ tokens, micro-batch 16: CUDA out of memory.*"
                                            r"checkpoint .*step 2\) is intact.*--resume"):
        train(make_cfg(warm_model, out, steps=4), tracker=NullTracker(), progress=False)
    assert json.loads((out / "checkpoint" / "trainer_state.json").read_text())["step"] == 2
    assert len(rows(out)) == 2
    monkeypatch.setattr(loop, "_update", real)
    got = rows(train(make_cfg(warm_model, out, steps=4), resume=True, tracker=NullTracker(), progress=False))
    keys = ("reward_mean", "loss", "grad_norm", "mismatch_kl")
    flat = [r[k] for r in got for k in keys]
    assert flat == pytest.approx([r[k] for r in ref for k in keys], rel=1e-5, abs=1e-7)


def test_one_update_per_batch_skips_the_old_logprob_pass_with_the_same_loss(warm_model, tmp_path, monkeypatch):
    """μ = 1: the old log-probs are the update's own forward, detached — no separate no-grad pass runs, and the
    loss, gradient norm, mismatch statistics (and, with TIS, its weights) equal the two-pass update's
    (`algorithm.old_logprob_pass: true`) to float rounding; the weights after the step agree too."""
    from qerl.train import update

    calls = []
    real = update.logprobs_no_grad

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(update, "logprobs_no_grad", spy)
    runs = {}
    for two_pass in (False, True):
        calls.clear()
        out = train(make_cfg(warm_model, tmp_path / f"p{int(two_pass)}", method="qerl", steps=1,
                             **{"algorithm.old_logprob_pass": two_pass, "algorithm.tis_cap": 2.0,
                                "aqn.apply_to": "rollout+train"}), tracker=NullTracker(), progress=False)
        runs[two_pass] = (rows(out)[0], len(calls))
    (one, n_one), (two, n_two) = runs[False], runs[True]
    assert n_one == 0 and n_two == 1  # one micro-batch of 16 rows: one no-grad pass in the two-pass update
    for k in ("loss", "grad_norm", "mismatch_kl", "is_ratio_mean", "is_ratio_max", "entropy", "clip_frac"):
        assert one[k] == pytest.approx(two[k], rel=1e-4, abs=1e-6), k
    assert one["reward_mean"] == two["reward_mean"]
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "p0" / "final" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "p1" / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6) for k in a)


def test_auto_micro_batch_trains_and_says_what_it_chose(warm_model, tmp_path, capsys):
    out = train(make_cfg(warm_model, tmp_path / "auto", steps=1, micro_batch_size="auto"), tracker=NullTracker(),
                progress=False)
    assert "micro_batch_size auto: 16 of 16 sequences" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["micro_batch_size"] == 16 and len(rows(out)) == 1


def test_engine_rollouts_log_their_split(warm_model, tmp_path):
    """With the rollout engine (forced on the CPU here), every step's metrics carry its prefill / capture /
    host-check seconds (inside ``rollout_gen_seconds``); the reference sampler logs none of them."""
    from qerl.train.steps import ENGINE_SPLIT

    out = train(make_cfg(warm_model, tmp_path / "eng", steps=2, **{"rollout.engine": "engine"}),
                tracker=NullTracker(), progress=False)
    for r in rows(out):
        parts = [r[k] for k in ENGINE_SPLIT.values()]
        assert all(v >= 0 for v in parts) and r["rollout_prefill_seconds"] > 0, r
        assert sum(parts) <= r["rollout_gen_seconds"]
    ref = train(make_cfg(warm_model, tmp_path / "ref", steps=1, **{"rollout.engine": "reference"}),
                tracker=NullTracker(), progress=False)
    assert not any(k in r for r in rows(ref) for k in ENGINE_SPLIT.values())


def test_aqn_enabled_on_a_bf16_lora_base_and_off_for_qerl(warm_model, tmp_path):
    """`aqn.enabled`: auto = the method's own (qerl only); true adds the noise to another method (the bf16 LoRA +
    AQN ablation); false removes it from qerl."""
    from qerl.rl.aqn import AQNSettings, enabled

    assert enabled(AQNSettings(), True) and not enabled(AQNSettings(), False)
    assert enabled(AQNSettings(enabled=True), False) and not enabled(AQNSettings(enabled="false"), True)
    with pytest.raises(ValueError, match="aqn.enabled must be auto, true or false"):
        AQNSettings(enabled="sometimes")
    sig = {}
    for name, method, flag in (("lora_aqn", "lora", True), ("lora", "lora", "auto"), ("qerl_off", "qerl", False)):
        out = train(make_cfg(warm_model, tmp_path / name, method=method, steps=2, **{"aqn.enabled": flag}),
                    tracker=NullTracker(), progress=False)
        sig[name] = [r["sigma"] for r in rows(out)]
    assert sig["lora_aqn"][-1] > 0 and sig["lora"] == [0.0, 0.0] and sig["qerl_off"] == [0.0, 0.0]
