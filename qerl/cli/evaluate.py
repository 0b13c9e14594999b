"""``qerl evaluate | report``: pass@1 of a policy on a benchmark, and the paper-shaped report of a results tree."""
from __future__ import annotations

import json
from pathlib import Path

from qerl.argtypes import POSITIVE, float_in, int_at_least
from qerl.cli.common import add_tracking


def add_evaluate(sub) -> None:
    v = sub.add_parser("evaluate", help="pass@1 over k samples on a benchmark",
                       description="Evaluate a base model or a trained policy (adapter on its quantized or bf16 "
                                   "base, as trained) on a benchmark: mean pass@1 over k samples per problem. "
                                   "Writes a summary JSON and per-sample JSONL.")
    v.add_argument("--model", required=True, help="base model directory (bf16, or NVFP4 checkpoint)")
    v.add_argument("--base", choices=["bf16", "nvfp4", "nf4"], required=True, help="format to run the base in")
    v.add_argument("--adapter", default=None, help="PEFT adapter directory (trained LoRA)")
    from qerl.data.tasks import REGISTERED_BENCHMARKS, VERIFIERS

    v.add_argument("--benchmark", required=True,
                   help=" | ".join(REGISTERED_BENCHMARKS) + ", or a local .jsonl / .parquet file (no hub needed; see "
                        "--prompt-field, --answer-field, --answer-format, --verifier); registered: "
                        + "; ".join(f"{n} ({b.doc}, verifier {b.verifier})" for n, b in REGISTERED_BENCHMARKS.items()))
    v.add_argument("--prompt-field", default=None, help="local file: the field holding the problem (default prompt)")
    v.add_argument("--answer-field", default=None, help="local file: the field holding the gold answer (default answer)")
    v.add_argument("--answer-format", default=None, choices=["plain", "gsm8k", "boxed", "aime"],
                   help="local file: how the answer field holds the answer (plain; gsm8k: after '####'; boxed: the "
                        "last \\boxed{}; aime: an integer 0-999) (default plain)")
    v.add_argument("--verifier", default=None, choices=list(VERIFIERS),
                   help="local file: how answers are judged (exact: the extracted answer equals the gold string; math: "
                        "math-verify's equivalence) (default math)")
    v.add_argument("--revision", default=None,
                   help="hub benchmark: the dataset commit to read (the workflow's inputs lock; default its registered "
                        "revision)")
    v.add_argument("--name", default=None, help="local file: the benchmark's name in the results (default: its stem)")
    v.add_argument("--output", required=True, help="summary JSON path")
    v.add_argument("--samples-output", default=None, help="per-sample JSONL (default: beside the JSON)")
    v.add_argument("--overwrite", action="store_true",
                   help="replace an --output that holds the evaluation of another model / adapter / benchmark")
    v.add_argument("--samples", type=POSITIVE, default=4, help="k samples per problem (pass@1 is their mean)")
    v.add_argument("--temperature", type=float_in(0.0), default=0.6,
                   help="sampling temperature (0 = greedy; paper 0.6)")
    v.add_argument("--top-p", type=float_in(0.0, 1.0, lo_open=True), default=0.95,
                   help="nucleus sampling mass (paper 0.95)")
    v.add_argument("--max-new-tokens", type=POSITIVE, default=4096, help="completion length limit (paper 4096)")
    v.add_argument("--batch-size", type=POSITIVE, default=32, help="sequences per generation batch")
    v.add_argument("--limit", type=POSITIVE, default=None, help="only the first N problems (default: all)")
    v.add_argument("--template", default="paper", choices=["raw", "chat", "paper"],
                   help="prompt template for hub benchmarks")
    v.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="compute dtype of the model")
    v.add_argument("--nf4-weights", default="eager", choices=["eager", "dense"],  # (qerl.rollout.sampling.NF4_WEIGHTS)
                   help="an NF4 (QLoRA) base in the rollout engine: eager (its bitsandbytes modules, dequantized on "
                        "every call) or dense (dequantized once, run like a bf16 base: the same values, ~18x faster "
                        "at 0.5B, for a bf16 copy of the base in memory)")
    v.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    v.add_argument("--seed", type=int_at_least(0), default=0, help="sampling seed")
    v.add_argument("--no-progress", action="store_true",
                   help="no progress bar: one log line per chunk of problems instead (workflow jobs)")
    v.set_defaults(func=run_evaluate)
    add_tracking(v)


def run_evaluate(args) -> dict:
    from qerl import outputs
    from qerl.stages.evaluate import (
        EvalSettings, check_outputs_are_ours, evaluate, load_for_eval, precheck, resolve_benchmark,
    )
    from qerl.train.methods import DTYPES, resolve_device

    settings = EvalSettings(samples=args.samples, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, limit=args.limit,
                            seed=args.seed, template=args.template, nf4_weights=args.nf4_weights)
    # an unknown benchmark (or a missing file) is named before the model loads
    bench = resolve_benchmark(args.benchmark, args.name, args.prompt_field, args.answer_field, args.answer_format,
                              args.revision, args.verifier)
    device = resolve_device(args.device)
    out = Path(args.output)
    samples = Path(args.samples_output) if args.samples_output else out.with_suffix(".samples.jsonl")
    outputs.check_file_output(out, "--output summary")
    outputs.check_file_output(samples, "--samples-output file")
    for path, flag in ((out, "--output"), (samples, "--samples-output")):
        outputs.check_not_input(path, {"--model": args.model, "--adapter": args.adapter}, flag)
    check_outputs_are_ours(out, samples, {"model": str(args.model), "base": args.base,
                                          "adapter": str(args.adapter or ""), "benchmark": bench.name},
                           overwrite=args.overwrite)
    with outputs.hold(out, "evaluate"):
        import torch

        precheck(args.model, bench, settings, args.adapter)
        model, tok = load_for_eval(args.model, args.base, args.adapter, DTYPES[args.dtype], device)
        from qerl.models.gguf import source_tags
        from qerl.stages.evaluate import adapter_sha256

        meta = {"model": str(args.model), "base": args.base, "adapter": str(args.adapter or ""),
                "adapter_sha256": adapter_sha256(args.adapter), "device": str(device) if device.type != "cuda"
                else torch.cuda.get_device_name(device), **source_tags(args.model)}
        with torch.no_grad():
            summary = evaluate(model, tok, bench, settings, out, samples, progress=not args.no_progress, meta=meta)
    print(json.dumps({k: summary[k] for k in ("benchmark", "pass@1", "problems", "samples_per_problem")}))
    return {"pass_at_1": summary["pass@1"], "problems": summary["problems"]}


def add_report(sub) -> None:
    rp = sub.add_parser("report", help="tables (paper-shaped, paper numbers adjacent), figures, index.md",
                        description="Build Table 1 / Table 2 (Markdown + CSV) with the paper's numbers in adjacent "
                                    "columns, training-curve / σ / accuracy figures and an index.md, from results/.")
    rp.add_argument("--workflow-config", required=True, help="the workflow config (config/*.yaml)")
    rp.add_argument("--results", default="results", help="the workflow's results directory (train/, eval/)")
    rp.add_argument("--output", required=True, help="report directory, e.g. reports/<configuration>")
    rp.set_defaults(func=run_report)
    add_tracking(rp)


def run_report(args) -> dict:
    from qerl import outputs
    from qerl.stages.report import build_report, check_report_dir, load_workflow_config

    config = load_workflow_config(Path(args.workflow_config))
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise outputs.OutputNotWritable(f"--output {out}: is a file, not a directory")
    outputs.check_not_input(out, {"--results": args.results, "--workflow-config": args.workflow_config})
    outputs.check_parent_writable(out, "report")
    check_report_dir(out)
    with outputs.hold(out, "report"):
        idx = build_report(config, Path(args.results), out)
    print(f"wrote {idx}")
    if getattr(args, "mlflow_run_name", None):  # (the workflow's report job) every arm in this experiment
        import os

        from qerl.tracking_links import link_report_runs

        uri = args.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI")
        experiment = args.mlflow_experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "qerl"
        made = link_report_runs(uri, experiment, config, Path(args.results))
        if made:
            print(f"MLflow: {made} arm(s) of this report trained under another configuration linked into experiment "
                  f"{experiment!r} (tagged qerl.linked_from)")
    return {}


def add_claims(sub) -> None:
    c = sub.add_parser("claims", help="methods side by side against the paper's claims (accuracy with intervals, "
                                      "curves, step time, GPU-hours)",
                       description="From a workflow's results: one row per method x seed (pass@1 before / after, "
                                   "adapter sha256, device, step time, GPU-hours), pass@1 per method with 95% "
                                   "bootstrap intervals over problems and seeds, training curves with 95% bands over "
                                   "seeds, and the paper's claims (a) accuracy, (b) reward growth, (c1)/(c2) entropy, "
                                   "(d) step time, each marked confirmed, refuted, inconclusive or not judged "
                                   "under the decision "
                                   "rule claims.md states. From --results, or from committed --evidence alone; "
                                   "--pack writes that evidence, --sweep a learning-rate sweep's table. A bases-only "
                                   "config (experiments: [], evaluation.base_models; config/real/bases.yaml) gives "
                                   "the bases table instead: bases.csv / .md, the chosen NVFP4 base and its gap to "
                                   "bf16.")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--workflow-config", help="the workflow config (results/config/<name>.yaml), read with --results")
    src.add_argument("--evidence", metavar="DIR",
                     help="an evidence directory (config.yaml, metrics.jsonl.gz, evaluations.jsonl.gz, e.g. "
                          "reports/real/evidence/real): the report is rebuilt from it alone")
    c.add_argument("--results", default="results", help="the workflow's results directory (train/, eval/)")
    c.add_argument("--output", help="report directory, e.g. reports/real")
    c.add_argument("--benchmark", default=None, help="benchmark to compare on (default: report.table1's)")
    c.add_argument("--timing", nargs="*", default=[], metavar="METHOD=FILE",
                   help="step times for claim (d) from runs that had the GPU to themselves: METHOD=metrics.jsonl, one "
                        "per timed run (5 or more a method are judged: a t-interval over runs), or "
                        "METHOD=step_alone.csv of an earlier "
                        "report (workflow runs that shared GPUs do not time fairly)")
    c.add_argument("--matched-rate", metavar="DIR", type=Path,
                   help="an evidence directory of runs of NVFP4 LoRA and bf16 LoRA at one common learning rate "
                        "(config/real/matched_rate.yaml): claim (c1) is judged on them, where the rate cannot enter")
    c.add_argument("--step-table", nargs="*", default=[], type=Path, metavar="CSV",
                   help="reports/step/<device>.csv tables: claim (d) also at 7B-32B, where the paper makes it (bf16 "
                        "LoRA / QeRL step time per model and batch)")
    c.add_argument("--sweep", action="store_true",
                   help="the runs are a learning-rate sweep (config/real/lr_sweep.yaml): write lr_sweep.csv / .md "
                        "(pass@1 on the validation benchmark per rate, the chosen rate per method) instead")
    c.add_argument("--base-kl", type=Path, metavar="CSV",
                   help="bases-only config: the CSV of python -m qerl.bench.base_kl (perplexity, KL against bf16), "
                        "joined to the bases table")
    c.add_argument("--pack", metavar="DIR",
                   help="instead of a report: add the runs and evaluations under --results (with --workflow-config) "
                        "to the evidence directory DIR (compressed; a batch at a time, rerunnable)")
    c.set_defaults(func=run_claims)


def run_claims(args) -> int:
    import tempfile

    from qerl.stages.claims import ClaimsError, build, read_timing
    from qerl.stages.report import load_workflow_config

    if args.pack:
        from qerl import outputs
        from qerl.stages.evidence import pack

        if not args.workflow_config:
            raise ClaimsError("--pack DIR needs --workflow-config (the config the runs under --results were made with)")
        outputs.check_parent_writable(Path(args.pack), "evidence directory")
        with outputs.hold(Path(args.pack), "claims --pack"):  # one writer at a time: a second is refused, not merged
            n = pack(Path(args.results), Path(args.workflow_config), Path(args.pack))
        print(f"{args.pack}: evidence of {n['runs']} runs, {n['evaluations']} evaluations and {n['completions']} "
              "graded completions")
        for run in n.get("unfinished", []):
            print(f"  left out (no summary.json: training unfinished): {run}")
        return 0
    if not args.output:
        raise ClaimsError("--output DIR is required (where the report is written)")
    from qerl import outputs
    from qerl.stages.report_set import check_output, staged

    final = Path(args.output)
    check_output(final, None if args.evidence else Path(args.results), Path(args.evidence) if args.evidence else None)
    outputs.check_parent_writable(final, "report")
    with tempfile.TemporaryDirectory(prefix="qerl-evidence-") as tmp, outputs.hold(final, "claims"), \
            staged(final) as out:
        shown = args.output
        args.output = str(out)  # every file of the set goes to the staging folder, renamed into place at the end
        if args.evidence:
            from qerl.stages.evidence import unpack

            config, results = unpack(Path(args.evidence), Path(tmp)), Path(tmp)
        else:
            config, results = load_workflow_config(Path(args.workflow_config)), Path(args.results)
        from qerl.stages.bases import build_bases, is_bases_only

        if is_bases_only(config):
            info = build_bases(config, results, Path(args.output), args.benchmark, args.base_kl)
            lo, hi = info["gap"][1:]
            from qerl.stages.numbers import p1

            print(f"chosen base: {info['chosen']} (gap to bf16 on {info['reported']}: {p1(info['gap'][0], True)} "
                  f"points [{p1(lo, True)}, {p1(hi, True)}])")
            print(f"wrote {shown}/bases.csv")
            return 0
        if args.base_kl:
            raise ClaimsError("--base-kl: only for a bases-only config (experiments: [], evaluation.base_models)")
        if args.sweep:
            from qerl.stages.sweep import build_sweep

            chosen = build_sweep(config, results, Path(args.output), args.benchmark)
            print("chosen learning rates: " + ", ".join(f"{m} {lr:g}" for m, lr in sorted(chosen.items())))
            print(f"wrote {shown}/lr_sweep.csv")
            return 0
        timing = read_timing(args.timing) or None
        matched = None
        if args.matched_rate:
            from qerl.stages.evidence import unpack

            mdir = Path(tmp) / "matched-rate"
            matched = (unpack(args.matched_rate, mdir), mdir)
        result = build(config, results, Path(args.output), args.benchmark, timing, args.step_table or None,
                       matched)
    for c in result["claims"]:
        print(f"{c['verdict']:>12}  {c['claim']}")
    if not result["runs"]:
        print(f"no training run yet: wrote {shown}/benchmarks.md ({result['bases']} untrained bases) and "
              f"{shown}/claims.md (no verdict)")
        return 0
    for what, key in (("no metrics or no evaluation", "missing"), ("training unfinished", "unfinished")):
        if result.get(key):
            print(f"left out ({what}): {len(result[key])} run(s): {', '.join(result[key][:4])}"
                  f"{' …' if len(result[key]) > 4 else ''}")
    print(f"wrote {shown}/claims.md ({result['runs']} runs)")
    return 0
