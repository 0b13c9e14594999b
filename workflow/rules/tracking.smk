# MLflow: the store, this configuration's experiment and the run of this invocation are created once, before any
# job starts, so that parallel jobs only append runs, each nested under the invocation's run
# ($QERL_MLFLOW_PARENT_RUN_ID, inherited by the jobs). Not a job of the DAG: where runs are logged is not part of any
# job's identity (an ablation overlay names another experiment and reruns nothing it shares with a finished run;
# common.smk). Hooks do not run on a dry run, or when there is nothing to do.

from qerl.tracking import PARENT_ENV  # (the run id of this invocation, inherited by the jobs)

_MLFLOW_CMD = ["qerl"] if _CONDA else [sys.executable, "-m", "qerl"]


def _mlflow(*args, what):
    done = subprocess.run([*_MLFLOW_CMD, "mlflow-init", "--tracking-uri", MLFLOW_URI, *args], capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise WorkflowError(f"MLflow store {MLFLOW_URI} (experiment {CONFIGURATION!r}): {what} failed: "
                            f"{(done.stderr or done.stdout).strip()[-1500:]}")
    return done.stdout


def _check_cluster():
    """On SLURM, before any job is submitted: every partition the profile or the command line names exists."""
    if getattr(workflow.executor_plugin, "name", None) != "slurm":
        return
    from qerl import cluster

    rs = workflow.resource_settings
    try:
        cluster.check_partitions(cluster.asked_partitions(rs.default_resources, rs.overwrite_resources),
                                 cluster.cluster_partitions())
    except cluster.ClusterError as e:
        raise WorkflowError(str(e)) from None


onstart:
    _check_cluster()
    _effective = f"results/mlflow/{CONFIGURATION}.config.yaml"
    write_text_atomic(_effective, yaml.safe_dump(config, sort_keys=False))
    _mlflow("--experiment", CONFIGURATION, "--output", MLFLOW_MARKER, "--parent-run", f"workflow · {CONFIGURATION}",
            "--config", _effective, "--param", f"configuration={CONFIGURATION}",
            "--param", f"config_hash={_CONFIG_HASH}", what="creating the store and the invocation's run")
    with open(MLFLOW_MARKER) as _f:
        os.environ[PARENT_ENV] = json.load(_f)["parent_run_id"]


def end_invocation_run(status):
    """Close the invocation's run (the Snakefile's onsuccess, and onerror below); a finished one keeps the report's
    figures and tables."""
    if os.environ.get(PARENT_ENV):
        _mlflow("--end", os.environ.pop(PARENT_ENV), "--status", status,
                *(["--artifacts", os.path.dirname(REPORT)] if status == "FINISHED" else []),
                what="closing the invocation's run")


onerror:
    end_invocation_run("FAILED")
