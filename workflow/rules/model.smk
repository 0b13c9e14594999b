# Get model: build the seeded tiny model offline (hub/local models are read in place).


rule build_tiny_model:
    output:
        directory("results/models/{model}"),
    params:
        arch=lambda wc: model_cfg(wc).get("arch", "qwen2"),
        seed=lambda wc: model_cfg(wc).get("seed", 0),
    conda:
        "../envs/qerl.yaml"
    log:
        "logs/build_tiny_model/{model}.log",
    shell:
        "qerl build-tiny --output {output} --arch {params.arch} --seed {params.seed} > {log} 2>&1"
