# Report: paper-shaped tables (Markdown + CSV), figures and index.md under results/reports/<configuration>/
# (`make example-report` copies the default's into the committed reports/default/). Each table and figure is an
# output marked with report(), captioned from workflow/report/, so `snakemake --report report.html` carries them;
# the files follow from the config alone (qerl.stages.report_figures.planned_files).
from qerl.stages.report_figures import planned_files

report: "../report/workflow.rst"


rule effective_config:
    output:
        f"results/config/{CONFIGURATION}.yaml",
    params:
        text=yaml.safe_dump(config, sort_keys=False),
    log:
        f"logs/effective_config/{CONFIGURATION}.log",
    run:
        write_text_atomic(output[0], params.text)


rule report:
    input:
        cfg=f"results/config/{CONFIGURATION}.yaml",
        evals=wc.eval_targets(config),
        train=[f"results/train/{r.path}/summary.json" for r in RUNS],
    output:
        index=REPORT,
        files=[report(os.path.join(os.path.dirname(REPORT), f.name), caption=f"../report/{f.caption}.rst",
                      category=f.category, labels={"file": f.name}) for f in planned_files(config)],
    params:
        out=lambda w, output: os.path.dirname(output.index),
        track=track("report"),
        results=lambda w, input: os.path.dirname(os.path.dirname(input.cfg)),
    resources:
        cpus_per_task=1,
        mem_mb=resources("quantize", "mem_mb", 4000),
        runtime=resources("quantize", "runtime", 60),
    log:
        f"logs/report/{CONFIGURATION}.log",
    conda:
        "../envs/qerl.yaml"
    shell:
        "qerl report --workflow-config {input.cfg} --results {params.results} --output {params.out} {params.track} > {log} 2>&1"
