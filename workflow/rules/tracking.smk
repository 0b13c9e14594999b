# MLflow: create the store and this configuration's experiment once, before parallel jobs log runs.


rule mlflow_init:
    output:
        MLFLOW_MARKER,
    params:
        uri=MLFLOW_URI,
        experiment=CONFIGURATION,
    log:
        "logs/mlflow_init/init.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        "qerl mlflow-init --tracking-uri '{params.uri}' --experiment {params.experiment} --output {output} > {log} 2>&1"
