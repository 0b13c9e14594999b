"""Every bad input is one clear line and loses nothing: a table of bad commands over train, evaluate, quantize,
report, plan, build-tiny and the workflow. Each case asserts the exit status, no traceback, the named field / file /
flag in the message, and that every file present before is byte-identical after."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
TRAIN = {
    "method": "lora", "steps": 2, "prompts_per_step": 2, "micro_batch_size": 8, "checkpoint_every": 1, "device": "cpu",
    "model": {"dtype": "float32"}, "data": {"task": "synthetic", "synthetic_size": 50},
    "rollout": {"max_new_tokens": 4}, "algorithm": {"group_size": 2}, "lora": {"r": 4, "alpha": 8},
    "reward": {"correctness": "exact"}, "optim": {"lr": 0.001}, "tracking": {"backend": "none"},
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model, its NVFP4 checkpoint, a finished training run and a few bad files, made once."""
    from qerl.cli import main
    from qerl.models.tiny import TinySpec, save_tiny_model

    root = tmp_path_factory.mktemp("bad")
    w = {"root": root, "model": save_tiny_model(root / "model", TinySpec(seed=3)),
         "wide": save_tiny_model(root / "wide", TinySpec(seed=3, hidden_size=128, intermediate_size=256)),
         "llama": save_tiny_model(root / "llama", TinySpec(arch="llama", seed=3)),
         "shallow": save_tiny_model(root / "shallow", TinySpec(seed=3, num_hidden_layers=1))}
    assert main(["quantize", "--model", str(w["model"]), "--output", str(root / "nvfp4"), "--no-progress"]) == 0
    w["nvfp4"] = root / "nvfp4"
    w["cfg"] = write_cfg(root / "train.yaml", w["model"], root / "run")
    assert main(["train", "--config", str(w["cfg"]), "--no-progress"]) == 0
    w["run"] = root / "run"
    # a bf16 model whose weights file was cut in half
    trunc = root / "truncated"
    shutil.copytree(w["model"], trunc)
    data = (trunc / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    w["truncated"] = trunc
    # a finished run whose checkpoint's trainable weights were cut
    broken = root / "broken_run"
    shutil.copytree(w["run"], broken)
    t = broken / "checkpoint" / "trainable.safetensors"
    t.write_bytes(t.read_bytes()[:100])
    w["broken_cfg"] = write_cfg(root / "broken.yaml", w["model"], broken)
    # a run that logged steps but stopped before its first checkpoint
    started = root / "started"
    started.mkdir()
    (started / "config.json").write_text((w["run"] / "config.json").read_text())  # (written before the first row)
    (started / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.0}) + "\n")
    w["started_cfg"] = write_cfg(root / "started.yaml", w["model"], started)
    # someone else's metrics.jsonl (no run config beside it): never replaced
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    w["foreign_cfg"] = write_cfg(root / "foreign.yaml", w["model"], foreign)
    (root / "a_file").write_text("not a directory\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "bad.yaml").write_text("steps: [1, 2\n")
    (root / "other").mkdir()
    (root / "other" / "notes.txt").write_text("someone's files\n")
    (root / "results_empty").mkdir()
    (root / "empty.jsonl").write_text("")
    long = root / "long.jsonl"
    long.write_text(json.dumps({"prompt": "7 " * 2000, "answer": "1"}) + "\n")
    w["long"] = long
    (root / "workflow.yaml").write_text((ROOT / "config" / "config.yaml").read_text())
    # a directory that is not a run, with a run's names in it
    notrun = root / "not_a_run"
    (notrun / "final").mkdir(parents=True)
    (notrun / "checkpoint").mkdir()
    (notrun / "notes.txt").write_text("mine\n")
    (notrun / "final" / "thesis.tex").write_text("\\section{mine}\n")
    (notrun / "checkpoint" / "important.txt").write_text("mine\n")
    w["notrun_cfg"] = write_cfg(root / "notrun.yaml", w["model"], notrun)
    (root / "dup.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(TRAIN))) + "steps: 100\n")
    hub = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    hub["models"] = {"q": {"source": "hub", "hub_id": "Qwen/Qwen2.5-3B-Instruct", "revision": "main"}}
    for block in hub["experiments"]:
        block["models"] = ["q"]
    (root / "hub.yaml").write_text(yaml.safe_dump(hub))
    (root / "other_repo.lock.yaml").write_text(yaml.safe_dump(
        {"models": {"q": {"repo": "someone/else", "revision": "main", "commit": "a" * 40}}, "datasets": {}}))
    (root / "binary.jsonl").write_bytes(bytes(range(256)) * 4)
    (root / "cut.gguf").write_bytes(b"GGUF" + bytes(12))
    (root / "binary.parquet").write_bytes(bytes(range(256)) * 4)
    (root / "dup_nested.yaml").write_text("optim:\n  lr: 0.001\n  lr: 0.1\nsteps: 2\n")
    (root / "empty_answers.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": ""}) + "\n"
                                                      for i in range(4)))
    (root / "other_eval.json").write_text(json.dumps({"pass@1": 0.5, "model": "elsewhere/model", "base": "bf16",
                                                      "adapter": "", "benchmark": "synthetic_test"}))
    return w


def write_cfg(path: Path, model: Path, out: Path, **over) -> Path:
    cfg = json.loads(json.dumps(TRAIN))
    cfg["model"]["path"], cfg["output_dir"] = str(model), str(out)
    cfg.update(over)
    path.write_text(yaml.safe_dump(cfg))
    return path


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def W(key: str):
    """A path of the shared world, resolved when the case runs."""
    return ("world", key)


def R(name: str):
    """A path under the world's root."""
    return ("root", name)


# (id, argv, expected exit status, fragments the one-line message must contain)
CASES = [
    # train: the output directory is owned
    ("train-into-finished-run", ["train", "--config", W("cfg")], 2, ["holds a finished run", "--resume", "--overwrite"]),
    ("train-finished-run-fewer-steps", ["train", "--config", W("cfg"), "--set", "steps=1"], 2, ["finished run (2 steps"]),
    ("train-auto-resume-no-checkpoint", ["train", "--config", W("started_cfg"), "--auto-resume"], 2,
     ["no checkpoint to resume from", "--overwrite"]),
    ("train-resume-nothing", ["train", "--config", W("started_cfg"), "--resume"], 2, ["checkpoint does not exist"]),
    ("train-rerun-over-foreign-metrics", ["train", "--config", W("foreign_cfg"), "--rerun"], 2,
     ["not a qerl run's", "metrics.jsonl (without the config.json"]),
    ("train-resume-truncated-checkpoint", ["train", "--config", W("broken_cfg"), "--resume"], 2,
     ["trainable.safetensors", "truncated or corrupt"]),
    ("train-resume-other-settings", ["train", "--config", W("cfg"), "--resume", "--set", "optim.lr=0.5"], 2,
     ["other settings", "optim.lr"]),
    ("train-resume-and-overwrite", ["train", "--config", W("cfg"), "--resume", "--overwrite"], 2,
     ["--overwrite", "not allowed with"]),
    # train: the config file and --set
    ("train-config-missing", ["train", "--config", R("nope.yaml")], 2, ["nope.yaml", "not found"]),
    ("train-config-is-dir", ["train", "--config", R("other")], 2, ["other", "is a directory"]),
    ("train-config-bad-yaml", ["train", "--config", R("bad.yaml")], 2, ["bad.yaml", "not valid YAML", "line 1"]),
    ("train-config-top-level-list", ["train", "--config", R("list.yaml"), "--set", "steps=1"], 2,
     ["list.yaml", "must be a mapping"]),
    ("train-set-through-a-value", ["train", "--config", W("cfg"), "--set", "steps.x=1"], 2, ["steps.x", "is a value"]),
    ("train-set-no-equals", ["train", "--config", W("cfg"), "--set", "steps"], 2, ["--set 'steps'", "KEY=VALUE"]),
    ("train-unknown-key", ["train", "--config", W("cfg"), "--set", "stepz=3"], 2, ["unknown key", "stepz"]),
    ("train-nan-lr", ["train", "--config", W("cfg"), "--set", "optim.lr=.nan"], 2, ["optim.lr", "finite"]),
    ("train-inf-clip", ["train", "--config", W("cfg"), "--set", "optim.grad_clip=.inf"], 2, ["optim.grad_clip", "finite"]),
    ("train-negative-lr", ["train", "--config", W("cfg"), "--set", "optim.lr=-1"], 2, ["optim.lr", "> 0"]),
    ("train-zero-steps", ["train", "--config", W("cfg"), "--set", "steps=0"], 2, ["steps", ">= 1"]),
    ("train-bad-method", ["train", "--config", W("cfg"), "--set", "method=dpo"], 2, ["method", "dpo"]),
    ("train-beta-out-of-range", ["train", "--config", W("cfg"), "--set", "optim.beta2=1.5"], 2, ["optim.beta2"]),
    ("train-output-is-file", ["train", "--config", W("cfg"), "--set", ("output_dir", R("a_file"))], 2,
     ["a_file", "is a file"]),
    ("train-output-under-file", ["train", "--config", W("cfg"), "--set", ("output_dir", R("a_file/run"))], 2,
     ["a_file", "is a file"]),
    ("train-device-cuda-without-gpu", ["train", "--config", W("cfg"), "--overwrite", "--set", "device=cuda",
                                       "--set", ("output_dir", R("cuda_run"))], 2, ["device", "cuda", "no usable CUDA"]),
    ("train-model-missing", ["train", "--config", W("cfg"), "--set", ("model.path", R("no_model")),
                             "--set", ("output_dir", R("run_nomodel"))], 2, ["no_model", "no such model directory"]),
    ("train-model-not-a-model", ["train", "--config", W("cfg"), "--set", ("model.path", R("other")),
                                 "--set", ("output_dir", R("run_other"))], 2, ["other", "no config.json"]),
    ("train-truncated-bf16-weights", ["train", "--config", W("cfg"), "--set", ("model.path", W("truncated")),
                                      "--set", ("output_dir", R("run_trunc"))], 2,
     ["model.safetensors", "truncated or corrupt"]),
    ("train-prompt-longer-than-context", ["train", "--config", W("cfg"), "--set", ("output_dir", R("run_long")),
                                          "--set", "data.task=local", "--set", ("data.path", W("long"))], 2,
     ["no prompt fits", "max_position_embeddings 512"]),
    ("train-completion-longer-than-context", ["train", "--config", W("cfg"), "--set", ("output_dir", R("run_ctx")),
                                              "--set", "rollout.max_new_tokens=4096"], 2,
     ["rollout.max_new_tokens 4096", "context of 512"]),
    ("train-local-data-missing", ["train", "--config", W("cfg"), "--set", ("output_dir", R("run_data")),
                                  "--set", "data.task=local", "--set", ("data.path", R("none.jsonl"))], 2,
     ["none.jsonl", "not found"]),
    ("train-nproc-zero", ["train", "--config", W("cfg"), "--nproc", "0"], 2, ["--nproc", "must be >= 1"]),
    ("train-unknown-template", ["train", "--config", W("cfg"), "--set", "data.template=chatty"], 2,
     ["data.template", "chatty"]),
    ("train-unknown-lora-target", ["train", "--config", W("cfg"), "--set", "lora.targets=[foo_proj]"], 2,
     ["lora.targets", "foo_proj"]),
    ("train-local-data-empty", ["train", "--config", W("cfg"), "--set", ("output_dir", R("run_empty")),
                                "--set", "data.task=local", "--set", ("data.path", R("empty.jsonl"))], 2,
     ["empty.jsonl", "no problems"]),
    ("train-local-without-path", ["train", "--config", W("cfg"), "--set", "data.task=local"], 2, ["data.path"]),
    ("train-into-the-model", ["train", "--config", W("cfg"), "--set", ("output_dir", W("model"))], 2,
     ["is the input model.path", "choose another output_dir"]),
    ("train-into-a-parent-of-the-model", ["train", "--config", W("cfg"), "--set", ("output_dir", R("."))], 2,
     ["contains the input model.path"]),
    ("train-into-a-model-directory", ["train", "--config", W("cfg"), "--set", ("output_dir", W("wide")), "--overwrite"],
     2, ["holds model weights", "model.safetensors"]),
    ("train-overwrite-a-directory-that-is-not-a-run", ["train", "--config", W("notrun_cfg"), "--overwrite"], 2,
     ["not a qerl run's", "final/thesis.tex", "checkpoint/important.txt"]),
    ("train-into-a-directory-that-is-not-a-run", ["train", "--config", W("notrun_cfg")], 2,
     ["not a qerl run's", "choose another output_dir"]),
    ("train-resume-finished-run-with-fewer-steps", ["train", "--config", W("cfg"), "--resume", "--set", "steps=1"],
     2, ["finished run (2 steps", "steps=1 would run nothing", "steps >= 2"]),
    ("train-config-key-twice", ["train", "--config", R("dup.yaml")], 2, ["dup.yaml", "'steps' is given twice"]),
    ("train-empty-gold-answers", ["train", "--config", W("cfg"), "--set", ("output_dir", R("run_empty_ans")),
                                  "--set", "data.task=local", "--set", ("data.path", R("empty_answers.jsonl"))], 2,
     ["empty_answers.jsonl", "row 0", "'answer' is empty"]),
    ("train-huge-synthetic-set", ["train", "--config", W("cfg"), "--set", "data.synthetic_size=1000000000000"], 2,
     ["synthetic_size"]),
    # sft / export-merged / quantize never replace what they did not write, nor their own input
    ("sft-into-its-input", ["sft", "--model", W("model"), "--output", W("model"), "--force"], 2,
     ["is the input --model"]),
    ("quantize-into-its-input", ["quantize", "--model", W("model"), "--output", W("model"), "--force"], 2,
     ["is the input --model"]),
    ("quantize-over-a-parent-of-its-input", ["quantize", "--model", W("model"), "--output", R("."), "--force"], 2,
     ["contains the input --model"]),
    ("export-over-existing-output", ["export-merged", "--base", W("model"), "--adapter", R("run/final"),
                                     "--output", R("other")], 2, ["other", "--force"]),
    ("eval-output-is-a-model-config", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark",
                                       "synthetic_test", "--output", R("model/config.json"), "--max-new-tokens", "8"],
     2, ["config.json", "not an evaluation summary"]),
    ("eval-samples-over-a-config", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark",
                                    "synthetic_test", "--output", R("e.json"), "--samples-output", R("train.yaml"),
                                    "--max-new-tokens", "8"], 2, ["train.yaml", "not an evaluation's samples"]),
    ("report-into-a-model-directory", ["report", "--workflow-config", R("workflow.yaml"), "--results", R("."),
                                       "--output", W("model")], 2, ["not an earlier report"]),
    ("download-among-other-files", ["download", "--model", "a/b", "--revision", "main", "--output", R("other")], 2,
     ["other", "not an earlier download"]),
    ("quantize-force-over-a-training-run", ["quantize", "--model", W("model"), "--output", R("run"), "--force"], 2,
     ["run", "which no qerl command wrote there", "replaces only what qerl wrote"]),
    ("tiny-force-over-a-training-run", ["build-tiny", "--output", R("run"), "--force"], 2,
     ["which no qerl command wrote there"]),
    ("sft-force-over-a-training-run", ["sft", "--model", W("model"), "--output", R("run"), "--force", "--steps", "1"],
     2, ["which no qerl command wrote there"]),
    ("export-force-over-other-files", ["export-merged", "--base", W("model"), "--adapter", R("run/final"),
                                       "--output", R("other"), "--force"], 2, ["other", "which no qerl command wrote there"]),
    ("quantize-force-over-notes", ["quantize", "--model", W("model"), "--output", R("other"), "--force"], 2,
     ["other", "notes.txt", "which no qerl command wrote there"]),
    ("tiny-force-over-notes", ["build-tiny", "--output", R("other"), "--force"], 2, ["which no qerl command wrote there"]),
    ("sft-force-over-notes", ["sft", "--model", W("model"), "--output", R("other"), "--force", "--steps", "1"], 2,
     ["which no qerl command wrote there"]),
    ("export-force-over-a-training-run", ["export-merged", "--base", W("model"), "--adapter", R("run/final"),
                                          "--output", R("broken_run"), "--force"], 2, ["which no qerl command wrote there"]),
    ("quantize-ignore-regex-matches-nothing", ["quantize", "--model", W("model"), "--output", R("q7"), "--ignore",
                                               "re:.*vision.*"], 2, ["--ignore 're:.*vision.*' matches no Linear"]),
    ("train-binary-data-file", ["train", "--config", W("cfg"), "--set", ("output_dir", R("run_bin")),
                                "--set", "data.task=local", "--set", ("data.path", R("binary.jsonl"))], 2,
     ["binary.jsonl", "not a UTF-8 text file"]),
    ("train-binary-parquet", ["train", "--config", W("cfg"), "--set", ("output_dir", R("run_binp")),
                              "--set", "data.task=local", "--set", ("data.path", R("binary.parquet"))], 2,
     ["binary.parquet", "not a readable Parquet file"]),
    ("eval-binary-benchmark", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark", R("binary.jsonl"),
                               "--output", R("eb.json")], 2, ["binary.jsonl", "not a UTF-8 text file"]),
    ("fetch-check-lock-top-level-list", ["fetch", "--configfile", R("workflow.yaml"), "--check", "--lock",
                                         R("list.yaml")], 2, ["list.yaml", "must be a mapping"]),
    ("fetch-check-lock-broken-yaml", ["fetch", "--configfile", R("workflow.yaml"), "--check", "--lock",
                                      R("bad.yaml")], 2, ["bad.yaml", "not valid YAML"]),
    ("fetch-check-lock-binary", ["fetch", "--configfile", R("workflow.yaml"), "--check", "--lock",
                                 R("binary.jsonl")], 2, ["binary.jsonl", "not a text file"]),
    ("fetch-check-lock-of-another-repo", ["fetch", "--configfile", R("hub.yaml"), "--check", "--lock",
                                          R("other_repo.lock.yaml")], 2,
     ["locked as someone/else@main", "asks for Qwen/Qwen2.5-3B-Instruct@main"]),
    ("fetch-config-key-twice", ["fetch", "--configfile", R("dup.yaml"), "--dry-run"], 2,
     ["dup.yaml", "given twice"]),
    ("train-unreachable-mlflow-server", ["train", "--config", W("cfg"), "--set", ("output_dir", R("run_ml")),
                                         "--set", "tracking.backend=mlflow",
                                         "--set", "tracking.tracking_uri=http://127.0.0.1:1/"], 2,
     ["tracking.tracking_uri http://127.0.0.1:1/", "cannot connect"]),
    ("quantize-unreachable-mlflow-server", ["quantize", "--model", W("model"), "--output", R("q8"),
                                            "--mlflow-run-name", "q", "--mlflow-uri", "http://127.0.0.1:1/"], 2,
     ["--mlflow-uri http://127.0.0.1:1/", "cannot connect"]),
    ("from-gguf-missing-file", ["from-gguf", "--gguf", R("none.gguf"), "--output", R("g1")], 2,
     ["none.gguf", "no such GGUF file"]),
    ("from-gguf-not-a-gguf", ["from-gguf", "--gguf", R("binary.jsonl"), "--output", R("g2")], 2,
     ["binary.jsonl", "not a GGUF file"]),
    ("from-gguf-truncated", ["from-gguf", "--gguf", R("cut.gguf"), "--output", R("g3")], 2,
     ["cut.gguf", "truncated or corrupt"]),
    ("from-gguf-force-over-a-training-run", ["from-gguf", "--gguf", R("cut.gguf"), "--output", R("run"), "--force"],
     2, ["run", "which no qerl command wrote there"]),
    ("from-gguf-output-is-a-file", ["from-gguf", "--gguf", R("cut.gguf"), "--output", R("a_file")], 2,
     ["a_file", "is a file"]),
    ("claims-results-missing", ["claims", "--workflow-config", R("workflow.yaml"), "--results", R("no_results"),
                                "--output", R("cl")], 2, ["no finished run has both metrics.jsonl"]),
    ("claims-timing-not-method-file", ["claims", "--workflow-config", R("workflow.yaml"), "--results",
                                       R("results_empty"), "--output", R("cl"), "--timing", "qerl"], 2,
     ["--timing 'qerl'", "METHOD=FILE"]),
    ("claims-config-missing", ["claims", "--workflow-config", R("nope.yaml"), "--output", R("cl")], 2,
     ["nope.yaml", "not found"]),
    ("eval-over-another-benchmarks-summary", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark",
                                              R("binary.jsonl"), "--output", R("other_eval.json")], 2,
     ["other_eval.json", "benchmark 'synthetic_test'", "--overwrite"]),
    ("train-nested-key-twice", ["train", "--config", R("dup_nested.yaml")], 2, ["'lr' is given twice"]),
    ("quantize-ignore-matches-nothing", ["quantize", "--model", W("model"), "--output", R("q6"), "--ignore",
                                         "lm_haed"], 2, ["--ignore 'lm_haed' matches no Linear module"]),
    ("eval-summary-and-samples-same-file", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark",
                                            "synthetic_test", "--output", R("same.json"), "--samples-output",
                                            R("same.json")], 2, ["same file"]),
    ("eval-over-another-policys-summary", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark",
                                           "synthetic_test", "--output", R("other_eval.json"), "--max-new-tokens",
                                           "8"], 2, ["other_eval.json", "another policy", "elsewhere/model",
                                                     "--overwrite"]),
    ("sft-over-a-training-run", ["sft", "--model", W("model"), "--output", W("run"), "--steps", "1"], 2,
     ["run", "--force"]),
    ("export-adapter-of-another-model", ["export-merged", "--base", W("wide"), "--adapter", R("run/final"),
                                         "--output", R("merged")], 2, ["run/final", "adapter of another model"]),
    # evaluate
    ("eval-adapter-of-another-model", ["evaluate", "--model", W("wide"), "--base", "bf16", "--benchmark",
                                       "synthetic_test", "--adapter", R("run/final"), "--output", R("e.json"),
                                       "--max-new-tokens", "8", "--device", "cpu"], 2,
     ["run/final", "adapter of another model"]),
    ("eval-adapter-on-a-llama-base-of-the-same-sizes", ["evaluate", "--model", W("llama"), "--base", "bf16",
                                                        "--benchmark", "synthetic_test", "--adapter", R("run/final"),
                                                        "--output", R("e.json"), "--max-new-tokens", "8",
                                                        "--device", "cpu"], 2,
     ["run/final", "adapter of another model", "model_type qwen2 vs llama"]),
    ("eval-adapter-on-a-base-with-fewer-layers", ["evaluate", "--model", W("shallow"), "--base", "bf16", "--benchmark",
                                                  "synthetic_test", "--adapter", R("run/final"), "--output",
                                                  R("e.json"), "--max-new-tokens", "8", "--device", "cpu"], 2,
     ["run/final", "num_hidden_layers 2 vs 1"]),
    ("export-adapter-on-a-llama-base", ["export-merged", "--base", W("llama"), "--adapter", R("run/final"),
                                        "--output", R("merged_llama")], 2, ["adapter of another model", "llama"]),
    ("eval-samples-zero", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark", "synthetic_test",
                           "--output", R("e.json"), "--samples", "0"], 2, ["--samples", "must be >= 1"]),
    ("eval-limit-zero", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark", "synthetic_test",
                         "--output", R("e.json"), "--limit", "0"], 2, ["--limit", "must be >= 1"]),
    ("eval-top-p-above-one", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark", "synthetic_test",
                              "--output", R("e.json"), "--top-p", "1.5"], 2, ["--top-p", "1.5"]),
    ("eval-output-is-dir", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark", "synthetic_test",
                            "--output", R("other")], 2, ["other", "existing directory"]),
    ("eval-unknown-benchmark", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark", "gsm9k",
                                "--output", R("e.json")], 2, ["gsm9k", "known"]),
    ("eval-model-missing", ["evaluate", "--model", R("no_model"), "--base", "bf16", "--benchmark", "synthetic_test",
                            "--output", R("e.json")], 2, ["no_model"]),
    ("eval-adapter-missing", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark", "synthetic_test",
                              "--adapter", R("no_adapter"), "--output", R("e.json"), "--max-new-tokens", "8"], 2,
     ["no_adapter"]),
    ("eval-device-cuda", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark", "synthetic_test",
                          "--output", R("e.json"), "--device", "cuda"], 2, ["device", "no usable CUDA"]),
    ("eval-longer-than-context", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark",
                                  "synthetic_test", "--output", R("e.json"), "--max-new-tokens", "100000"], 2,
     ["--max-new-tokens 100000", "context of 512"]),
    ("eval-output-under-file", ["evaluate", "--model", W("model"), "--base", "bf16", "--benchmark", "synthetic_test",
                                "--output", R("a_file/e.json")], 2, ["a_file", "is a file"]),
    # quantize
    ("quantize-over-other-files", ["quantize", "--model", W("model"), "--output", R("other"), "--no-progress"], 2,
     ["other", "--force"]),
    ("quantize-bad-shard-size", ["quantize", "--model", W("model"), "--output", R("q2"), "--max-shard-size", "huge"],
     2, ["--max-shard-size", "huge"]),
    ("quantize-bad-regex", ["quantize", "--model", W("model"), "--output", R("q5"), "--ignore", "re:["], 2,
     ["--ignore 're:['", "regular expression"]),
    ("quantize-zero-shard-size", ["quantize", "--model", W("model"), "--output", R("q2"), "--max-shard-size", "0"],
     2, ["--max-shard-size", "> 0"]),
    ("quantize-model-missing", ["quantize", "--model", R("no_model"), "--output", R("q3")], 2, ["no_model"]),
    ("quantize-output-is-file", ["quantize", "--model", W("model"), "--output", R("a_file")], 2,
     ["a_file", "is a file"]),
    ("quantize-truncated-source", ["quantize", "--model", W("truncated"), "--output", R("q4"), "--no-progress"], 2,
     ["model.safetensors", "truncated or corrupt"]),
    # report
    ("report-results-missing", ["report", "--workflow-config", R("workflow.yaml"), "--results", R("no_results"),
                                "--output", R("rep")], 2, ["no_results", "no such directory"]),
    ("report-results-empty", ["report", "--workflow-config", R("workflow.yaml"), "--results", R("results_empty"),
                              "--output", R("rep")], 2, ["results_empty", "nothing to report"]),
    ("report-config-missing", ["report", "--workflow-config", R("nope.yaml"), "--output", R("rep")], 2,
     ["nope.yaml", "not found"]),
    ("report-config-list", ["report", "--workflow-config", R("list.yaml"), "--output", R("rep")], 2,
     ["list.yaml", "must be a mapping"]),
    ("report-config-not-workflow", ["report", "--workflow-config", W("cfg"), "--output", R("rep")], 2,
     ["train.yaml", "unknown key 'algorithm' (did you mean 'algorithm_overrides'?)"]),
    # plan
    ("plan-nproc-zero", ["plan", "--config", W("cfg"), "--nproc", "0"], 2, ["--nproc", "must be >= 1"]),
    ("plan-negative-gpu", ["plan", "--config", W("cfg"), "--gpu-gb", "-5"], 2, ["--gpu-gb", "-5"]),
    ("plan-nan-config", ["plan", "--config", W("cfg"), "--set", "optim.lr=.nan"], 2, ["optim.lr", "finite"]),
    ("plan-bad-shape", ["plan", "--config", W("cfg"), "--shape", "70B"], 2, ["--shape", "70B"]),
    # build-tiny
    ("tiny-width-not-block", ["build-tiny", "--output", R("t1"), "--hidden-size", "72"], 2,
     ["hidden_size", "multiple of 16"]),
    ("tiny-heads-do-not-divide", ["build-tiny", "--output", R("t2"), "--heads", "3"], 2, ["hidden_size 64", "3"]),
    ("tiny-kv-heads-do-not-divide", ["build-tiny", "--output", R("t3"), "--kv-heads", "3"], 2, ["key/value heads"]),
    ("tiny-zero-layers", ["build-tiny", "--output", R("t4"), "--layers", "0"], 2, ["--layers", "must be >= 1"]),
    ("tiny-odd-head-dim", ["build-tiny", "--output", R("t5"), "--hidden-size", "48", "--heads", "16",
                           "--kv-heads", "4"], 2, ["head dimension 3", "even"]),
    ("tiny-over-other-files", ["build-tiny", "--output", R("other")], 2, ["other", "--force"]),
    ("tiny-bad-shard-size", ["build-tiny", "--output", R("t6"), "--max-shard-size", "lots"], 2, ["--max-shard-size"]),
]


def resolve(arg, world):
    if isinstance(arg, tuple) and len(arg) == 2 and arg[0] in ("world", "root"):
        return str(world[arg[1]] if arg[0] == "world" else world["root"] / arg[1])
    if isinstance(arg, tuple):  # ("key", path): --set key=path
        return f"{arg[0]}={resolve(arg[1], world)}"
    return arg


@pytest.mark.parametrize("argv, status, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_clear_line(world, argv, status, fragments, capsys):
    from qerl.cli import main

    argv = [resolve(a, world) for a in argv]
    before = snapshot(world["root"])
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors (usage + one line)
        rc = e.code
    err = capsys.readouterr().err
    assert rc == status, err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    for frag in fragments:
        assert frag in line, (frag, line)
    after = snapshot(world["root"])
    assert {k: after.get(k) for k in before} == before, "a file present before changed or vanished"


def test_the_table_has_enough_cases():
    assert len(CASES) >= 120
    assert {c[1][0] for c in CASES} >= {"train", "evaluate", "quantize", "report", "plan", "build-tiny"}


def test_workflow_refuses_a_nan_learning_rate_at_parse_time(tmp_path):
    """The workflow's config check runs every run's config through qerl train's validation before any job."""
    bad = tmp_path / "nan.yaml"
    bad.write_text(yaml.safe_dump({"train": {"optim": {"lr": float("nan")}}}))
    env = {**os.environ, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    out = subprocess.run([str(Path(sys.executable).parent / "snakemake"), "--snakefile", str(ROOT / "Snakefile"),
                          "--configfile", str(ROOT / "config" / "config.yaml"), str(bad), "--directory",
                          str(tmp_path), "-n", "--cores", "1"], cwd=ROOT, env=env, capture_output=True, text=True)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "optim.lr" in text and "finite" in text, text[-2000:]
    assert "Traceback" not in text
    assert not (tmp_path / "results").exists()


def test_a_full_disk_names_the_path_and_the_intact_checkpoint(world, tmp_path, monkeypatch, capsys):
    """The checkpoint of step 2 cannot be written (safetensors reports ENOSPC as its own error type): one line with
    the path and the step whose checkpoint is intact, which a later --auto-resume continues from. (The same on a
    real full tmpfs is in the issue's closing note; mounting needs privileges CI may not have.)"""
    from qerl.cli import main
    from qerl.train import state

    cfg = write_cfg(tmp_path / "c.yaml", world["model"], tmp_path / "run", steps=3)
    real, calls = state.save_file, []

    def full(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(*a, **k)

    monkeypatch.setattr(state, "save_file", full)
    assert main(["train", "--config", str(cfg), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "step 2: cannot write" in err and "no space left on the device" in err
    assert f"the checkpoint of step 1 ({tmp_path / 'run' / 'checkpoint'}) is intact" in err
    assert json.loads((tmp_path / "run" / "checkpoint" / "trainer_state.json").read_text())["step"] == 1
    assert not list((tmp_path / "run").glob(".checkpoint.*"))
    monkeypatch.setattr(state, "save_file", real)
    assert main(["train", "--config", str(cfg), "--no-progress", "--auto-resume"]) == 0
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_a_run_whose_metrics_end_in_a_cut_off_line_resumes(world, tmp_path):
    """A kill in the middle of writing a metrics row leaves a line without its newline: the run resumes from its
    intact checkpoint (the cut row is dropped and recomputed), without --overwrite."""
    from qerl.cli import main

    run = tmp_path / "cut"
    shutil.copytree(world["run"], run)
    (run / "summary.json").unlink()
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "reward_me')
    cfg = write_cfg(tmp_path / "cut.yaml", world["model"], run, steps=3)
    assert main(["train", "--config", str(cfg), "--resume", "--no-progress"]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and metrics.read_text().endswith("\n")


def test_outputs_get_the_umask_mode(world):
    """Checkpoint and adapter weights are written by safetensors with mode 0600; every output file gets the mode
    the umask gives (0644 under 022), so a group-shared results directory stays readable."""
    from qerl.checkpoint import umask_mode

    for f in ("checkpoint/trainable.safetensors", "final/adapter_model.safetensors", "final/adapter_config.json"):
        assert (world["run"] / f).stat().st_mode & 0o777 == umask_mode(), f
    assert (world["nvfp4"] / "model.safetensors").stat().st_mode & 0o777 == umask_mode()


def test_an_unknown_reward_is_named_before_any_model_loads():
    """issue 80 (unclear): `--set reward.correctness=fuzzy` was refused only after the model had loaded (~10 s)."""
    import dataclasses

    from qerl.rewards.registry import RewardSettings
    from qerl.train.config import ConfigError, TrainConfig, validate

    with pytest.raises(ConfigError,
                       match=r"config.reward.correctness: 'fuzzy' is not a registered reward \(.*exact.*math"):
        validate(dataclasses.replace(TrainConfig(), reward=RewardSettings(correctness="fuzzy")))


def test_a_cut_last_row_that_the_checkpoint_already_holds_is_marked_not_lost(world, tmp_path, capsys):
    """issue 80: a kill cut the last metrics row (step 2) after the step-2 checkpoint was saved; resuming ran step 3
    and finished with metrics at steps [1, 3] and a summary of 2 steps. Now the row is marked (its update is in the
    checkpoint, its numbers are gone), the steps stay whole and the summary says 3."""
    from qerl.cli import main

    run = tmp_path / "cut2"
    shutil.copytree(world["run"], run)
    (run / "summary.json").unlink()
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    metrics.write_text(lines[0] + "\n" + lines[1][:20])  # step 2's row cut mid-write
    cfg = write_cfg(tmp_path / "cut2.yaml", world["model"], run, steps=3)
    assert main(["train", "--config", str(cfg), "--resume", "--no-progress"]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1] == {"step": 2, "metrics_lost": True}
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert "the row of step(s) 2 was cut by an interrupted write" in capsys.readouterr().err
