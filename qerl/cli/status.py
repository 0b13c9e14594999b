"""``qerl status``: every training job of a workflow's results tree, while Snakemake runs (locally or on SLURM)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from qerl.argtypes import float_in


def add_status(sub) -> None:
    st = sub.add_parser("status", help="every training job of a results tree: step / total, reward, s/step, ETA",
                        description="Where each training run of a configuration stands (read from the files the jobs "
                                    "write, and from squeue on SLURM; writes nothing): finished, running, queued, "
                                    "failed (with its log's last line), stopped (a rerun resumes it) or not started; "
                                    "its step / total, last reward, seconds a step and the time left at that pace.")
    st.add_argument("results", nargs="?", default="results", type=Path, help="the workflow's results directory")
    st.add_argument("--configuration", default=None,
                    help="which configuration's runs (results/config/<name>.yaml; default: the latest invocation's)")
    st.add_argument("--watch", type=float_in(0.0, lo_open=True), default=None, metavar="SECONDS",
                    help="refresh every SECONDS until every run has finished or failed (Ctrl-C stops)")
    st.add_argument("--json", action="store_true", help="one JSON object per run instead of the table")
    st.set_defaults(func=run_status)


def run_status(args) -> int:
    from qerl.status import status, table

    while True:
        name, runs = status(args.results, args.configuration)
        if args.json:
            print("\n".join(json.dumps({**vars(r), "eta_s": r.eta_s}) for r in runs))
        else:
            print(table(runs, name), flush=True)
        if args.watch is None or all(r.state in ("finished", "failed") for r in runs):
            return 0
        time.sleep(args.watch)
        print()
