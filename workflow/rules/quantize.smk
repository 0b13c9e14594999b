# NVFP4 quantization (compressed-tensors nvfp4-pack-quantized checkpoint): round-to-nearest, or AWQ-calibrated
# (quantize.calibration / models.<name>.calibration: awq, on quantize.calibration_data).


rule quantize:
    input:
        model=lambda w: model_marker(w.model),
        calibration=lambda w: calibration_inputs(w.model),
    output:
        config="results/quantize/{model}/config.json",
        report="results/quantize/{model}/quantization_report.json",
    params:
        src=lambda w: model_path(w.model),
        out=lambda w, output: os.path.dirname(output.config),
        shard=config.get("quantize", {}).get("max_shard_size", "2GB"),
        rule=lambda w: quant_setting(w.model, "scale_rule", "max6"),
        keep=lambda w: quant_setting(w.model, "keep_bf16_last", 0),
        cal=lambda w: calibration_args(w.model),
        track=lambda w: track("quantize", model=w.model),
    resources:
        gpu=lambda w: quant_gpus(w.model),
        cpus_per_task=resources("quantize", "cpus", 1),
        mem_mb=resources("quantize", "mem_mb", 4000),
        runtime=resources("quantize", "runtime", 60),
    log:
        "logs/quantize/{model}.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        "QERL_CLAIM_GPUS={resources.gpu} qerl quantize --model {params.src} --output {params.out} --force --max-shard-size {params.shard} "
        "--scale-rule {params.rule} --keep-bf16-last {params.keep} {params.cal} "
        "--no-progress {params.track} > {log} 2>&1"
