# NVFP4 calibration-free quantization (compressed-tensors nvfp4-pack-quantized checkpoint).


rule quantize:
    input:
        quantize_source,
    output:
        config="results/quantize/{model}/config.json",
        report="results/quantize/{model}/quantization_report.json",
    params:
        model=quantize_model_arg,
        outdir=lambda wc, output: os.path.dirname(output.config),
        shard=config.get("quantize", {}).get("max_shard_size", "2GB"),
    conda:
        "../envs/qerl.yaml"
    log:
        "logs/quantize/{model}.log",
    shell:
        "qerl quantize --model {params.model} --output {params.outdir} --force "
        "--max-shard-size {params.shard} --no-progress > {log} 2>&1"
