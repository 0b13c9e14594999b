# Evaluation: every trained policy (as trained: adapter on its base) and the untrained bases (bf16, NVFP4, and NF4
# quantized on load by bitsandbytes where a config asks for QLoRA's base).


rule evaluate_trained:
    input:
        summary="results/train/{model}/{method}/{algo}/{dataset}/seed{seed}/summary.json",
        bench=lambda w: wc.benchmark_files(config, w.benchmark),
    output:
        "results/eval/{model}/{method}/{algo}/{dataset}/seed{seed}/{benchmark}.json",
    wildcard_constraints:
        method="|".join(re.escape(m) for m in TRAIN_METHODS),
        algo="|".join(wc.ALGORITHMS),
    params:
        policy=trained_policy,
        bench=lambda w: wc.benchmark_args(config, w.benchmark, LOCKED),
        opts=eval_opts(),
        track=lambda w: track("eval", model=w.model, method=w.method, algo=w.algo, dataset=w.dataset, seed=w.seed,
                              benchmark=w.benchmark),
    resources:
        gpu=resources("evaluate", "gpu", 0),
        cpus_per_task=resources("evaluate", "cpus", 1),
        mem_mb=resources("evaluate", "mem_mb", 8000),
        runtime=resources("evaluate", "runtime", 120),
    log:
        "logs/evaluate/{model}/{method}/{algo}/{dataset}/seed{seed}/{benchmark}.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        "QERL_CLAIM_GPUS={resources.gpu} qerl evaluate {params.policy} --benchmark {params.bench} --output {output} {params.opts} "
        "--no-progress {params.track} > {log} 2>&1"


rule evaluate_untrained:
    input:
        model=lambda w: f"results/quantize/{w.model}/config.json" if w.method == "nvfp4" else model_marker(w.model),
        bench=lambda w: wc.benchmark_files(config, w.benchmark),
    output:
        "results/eval/{model}/{method}/untrained/none/seed0/{benchmark}.json",
    wildcard_constraints:
        method="|".join(wc.UNTRAINED),
    params:
        src=lambda w, input: os.path.dirname(input.model),
        bench=lambda w: wc.benchmark_args(config, w.benchmark, LOCKED),
        opts=eval_opts(),
        track=lambda w: track("eval", model=w.model, method=w.method, algo="untrained", benchmark=w.benchmark),
    resources:
        gpu=resources("evaluate", "gpu", 0),
        cpus_per_task=resources("evaluate", "cpus", 1),
        mem_mb=resources("evaluate", "mem_mb", 8000),
        runtime=resources("evaluate", "runtime", 120),
    log:
        "logs/evaluate/{model}/{method}/untrained/{benchmark}.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        "QERL_CLAIM_GPUS={resources.gpu} qerl evaluate --model {params.src} --base {wildcards.method} --benchmark {params.bench} "
        "--output {output} {params.opts} --no-progress {params.track} > {log} 2>&1"
