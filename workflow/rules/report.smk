# Report: paper-shaped tables (Markdown + CSV), figures and index.md under results/reports/<configuration>/
# (`make example-report` copies the default's into the committed reports/default/).


rule effective_config:
    output:
        f"results/config/{CONFIGURATION}.yaml",
    params:
        text=yaml.safe_dump(config, sort_keys=False),
    log:
        f"logs/effective_config/{CONFIGURATION}.log",
    run:
        wc.write_text_atomic(output[0], params.text)


rule report:
    input:
        cfg=f"results/config/{CONFIGURATION}.yaml",
        evals=wc.eval_targets(config),
        train=[f"results/train/{r.path}/summary.json" for r in RUNS],
    output:
        REPORT,
    params:
        out=lambda w, output: os.path.dirname(output[0]),
        track=track("report", f"report/{CONFIGURATION}"),
        results=lambda w, input: os.path.dirname(os.path.dirname(input.cfg)),
    log:
        f"logs/report/{CONFIGURATION}.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        "qerl report --workflow-config {input.cfg} --results {params.results} --output {params.out} {params.track} > {log} 2>&1"
