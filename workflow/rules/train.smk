# RL training: one job per cell of the experiment matrix (model x method x algorithm x dataset x seed).


rule resolve_train_config:
    output:
        "results/train/{model}/{method}/{algo}/{dataset}/seed{seed}/train.yaml",
    params:
        text=train_config_text,  # a change to a run's resolved config reruns that run only
    log:
        "logs/resolve_train_config/{model}/{method}/{algo}/{dataset}/seed{seed}.log",
    run:
        write_text_atomic(output[0], params.text)


rule train:
    input:
        unpack(train_inputs),
    output:
        "results/train/{model}/{method}/{algo}/{dataset}/seed{seed}/summary.json",
    wildcard_constraints:
        method="|".join(re.escape(m) for m in TRAIN_METHODS),
        algo="|".join(wc.ALGORITHMS),
    resources:
        gpu=resources("train", "gpu", 0),
        cpus_per_task=resources("train", "cpus", 1),
        mem_mb=resources("train", "mem_mb", 8000),
        runtime=resources("train", "runtime", 120),
    params:
        launch=train_launch(),  # resources.train.gpu > 1: data-parallel over that many GPUs (torchrun)
    log:
        "logs/train/{model}/{method}/{algo}/{dataset}/seed{seed}.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        # --rerun: a job killed mid-run continues from its last checkpoint; one Snakemake reruns because its config
        # changed starts over, replacing its own run (qerl.train.ownership)
        "QERL_CLAIM_GPUS={resources.gpu} qerl train --config {input.cfg} --rerun --no-progress{params.launch} > {log} 2>&1"
