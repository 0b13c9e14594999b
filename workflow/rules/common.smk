# Helpers and wildcard constraints shared by all rules.
from snakemake.utils import validate

validate(config, os.path.join(workflow.basedir, "workflow/schemas/config.schema.yaml"))

MODELS = list(config["models"])


wildcard_constraints:
    model="|".join(re.escape(m) for m in MODELS),


def model_cfg(wildcards):
    return config["models"][wildcards.model]


def quantize_source(wildcards):
    """Input of the quantize rule: the built tiny model directory, or nothing for path models."""
    if model_cfg(wildcards)["source"] == "tiny":
        return f"results/models/{wildcards.model}"
    return []


def quantize_model_arg(wildcards):
    m = model_cfg(wildcards)
    if m["source"] == "tiny":
        return f"results/models/{wildcards.model}"
    rev = f" --revision {m['revision']}" if m.get("revision") else ""
    return f"{m['path']}{rev}"
