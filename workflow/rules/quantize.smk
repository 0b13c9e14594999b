# NVFP4 calibration-free quantization (compressed-tensors nvfp4-pack-quantized checkpoint).


rule quantize:
    input:
        model=lambda w: model_marker(w.model),
        mlflow=MLFLOW_MARKER,
    output:
        config="results/quantize/{model}/config.json",
        report="results/quantize/{model}/quantization_report.json",
    params:
        src=lambda w: model_path(w.model),
        out=lambda w, output: os.path.dirname(output.config),
        shard=config.get("quantize", {}).get("max_shard_size", "2GB"),
        rule=lambda w: config["models"][w.model].get("scale_rule", config.get("quantize", {}).get("scale_rule", "max6")),
        track=lambda w: track("quantize", f"quantize/{w.model}", model=w.model),
    resources:
        mem_mb=resources("quantize", "mem_mb", 4000),
        runtime=resources("quantize", "runtime", 60),
    log:
        "logs/quantize/{model}.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        "qerl quantize --model {params.src} --output {params.out} --force --max-shard-size {params.shard} "
        "--scale-rule {params.rule} "
        "--no-progress {params.track} > {log} 2>&1"
