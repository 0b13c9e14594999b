# Get model: build + warm-start the offline tiny model, or download a hub snapshot at a pinned revision.


rule build_tiny_model:
    output:
        "results/base_models/{model}/config.json",
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        arch=lambda w: config["models"][w.model].get("arch", "qwen2"),
        seed=lambda w: config["models"][w.model].get("seed", 0),
    resources:
        cpus_per_task=resources("quantize", "cpus", 1),
        mem_mb=resources("quantize", "mem_mb", 4000),
        runtime=resources("quantize", "runtime", 60),
    log:
        "logs/build_tiny_model/{model}.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        "qerl build-tiny --output {params.out} --arch {params.arch} --seed {params.seed} > {log} 2>&1"


rule warm_start:
    input:
        base="results/base_models/{model}/config.json",
    output:
        "results/models/{model}/config.json",
    wildcard_constraints:
        model="|".join(re.escape(m) for m in MODELS if model_source(m) == "tiny") or "^$",
    params:
        base=lambda w, input: os.path.dirname(input.base),
        out=lambda w, output: os.path.dirname(output[0]),
        steps=lambda w: config["models"][w.model].get("sft_steps", 80),
        seed=lambda w: config["models"][w.model].get("seed", 0),
        track=lambda w: track("sft", model=w.model),
    resources:
        cpus_per_task=resources("quantize", "cpus", 1),
        mem_mb=resources("quantize", "mem_mb", 4000),
        runtime=resources("quantize", "runtime", 60),
    log:
        "logs/warm_start/{model}.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        "qerl sft --model {params.base} --output {params.out} --steps {params.steps} --seed {params.seed} "
        "--no-progress {params.track} > {log} 2>&1"


rule download_model:
    output:
        "results/models/{model}/config.json",
    wildcard_constraints:
        model="|".join(re.escape(m) for m in MODELS if model_source(m) == "hub") or "^$",
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        hub_id=lambda w: config["models"][w.model]["hub_id"],
        revision=lambda w: config["models"][w.model]["revision"],
    resources:
        cpus_per_task=resources("quantize", "cpus", 1),
        mem_mb=resources("quantize", "mem_mb", 4000),
        runtime=resources("quantize", "runtime", 60),
    log:
        "logs/download_model/{model}.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        "qerl download --model {params.hub_id} --revision {params.revision} --output {params.out} > {log} 2>&1"


rule convert_gguf:
    # a local GGUF file (llama.cpp's format) -> the HF directory every stage reads (weights dequantized: the
    # directory's qerl_source.json and every run's MLflow tags say so); a rerun on the same file does nothing
    input:
        lambda w: config["models"][w.model]["path"],
    output:
        "results/models/{model}/config.json",
    wildcard_constraints:
        model="|".join(re.escape(m) for m in MODELS if model_source(m) == "gguf") or "^$",
    params:
        out=lambda w, output: os.path.dirname(output[0]),
    resources:
        cpus_per_task=resources("quantize", "cpus", 1),
        mem_mb=resources("quantize", "mem_mb", 4000),
        runtime=resources("quantize", "runtime", 60),
    log:
        "logs/convert_gguf/{model}.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        "qerl from-gguf --gguf {input:q} --output {params.out:q} --force > {log:q} 2>&1"
