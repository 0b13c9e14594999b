# MLflow: the store and this configuration's experiment are created once, before any job starts, so that parallel
# jobs only append runs. Not a job of the DAG: where runs are logged is not part of any job's identity (an ablation
# overlay names another experiment and reruns nothing it shares with a finished run; common.smk).


onstart:
    _cmd = ["qerl"] if _CONDA else [sys.executable, "-m", "qerl"]
    _init = subprocess.run([*_cmd, "mlflow-init", "--tracking-uri", MLFLOW_URI, "--experiment", CONFIGURATION,
                            "--output", MLFLOW_MARKER], capture_output=True, text=True)
    if _init.returncode != 0:
        raise WorkflowError(f"the MLflow store {MLFLOW_URI} (experiment {CONFIGURATION!r}) could not be created: "
                            f"{(_init.stderr or _init.stdout).strip()[-1500:]}")
