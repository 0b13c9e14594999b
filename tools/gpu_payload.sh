#!/usr/bin/env bash
# Build, on a machine with the package registry, what tools/gpu_run.sh carries to an offline GPU machine in calls of
# at most 64 MiB:
#   the model file (MODEL, default models/qwen2.5-coder-0.5b-instruct.gguf: the local GGUF config/real names),
#                                           checked against its sha256 (SHA);
#   .parts00 .. .parts10                     that file in 11 parts (NN.bin + SHA256SUMS: "sha256 name count"),
#                                           .parts00 small enough to travel beside .whl;
#   .whl/                                    the workflow's packages missing on the GPU machines' Python 3.12 (the
#                                           image's list in the device notes), as manylinux wheels; bitsandbytes
#                                           stripped to its CUDA 13.0 library, pulp to no solvers (the workflow
#                                           schedules greedily), mlflow to no web UI.
# usage: MODEL=FILE SHA=SHA256 bash tools/gpu_payload.sh      (idempotent)
# The model file must be there (any copy with that sha256); where no model hub is reachable, FETCH=CMD runs CMD to
# write it to $MODEL.tmp first (this project's machines: see the session notes for the command they use).
# Then: call 1 carries [".whl"], calls 2-12 one part each, all running gpu_run.sh (reports/real/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-models/qwen2.5-coder-0.5b-instruct.gguf}
SHA=${SHA:-1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32}
grep -qxF '/.parts*/' .git/info/exclude 2>/dev/null || printf '/.parts*/\n' >> .git/info/exclude
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n' >> .git/info/exclude
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if [ ! -f "$MODEL" ]; then
  [ -n "${FETCH:-}" ] || { echo "gpu_payload: $MODEL is missing: put the model file there (sha256 $SHA) or set FETCH" >&2; exit 1; }
  mkdir -p "$(dirname "$MODEL")" && bash -c "$FETCH"
  got=$(sha256sum "$MODEL.tmp" | awk '{print $1}')
  [ "$got" = "$SHA" ] || { echo "gpu_payload: the fetched model's sha256 $got != $SHA" >&2; rm -f "$MODEL.tmp"; exit 1; }
  mv "$MODEL.tmp" "$MODEL"
fi
if [ ! -d .parts10 ]; then
  head -c 17000000 "$MODEL" > "$tmp/00.bin"
  tail -c +17000001 "$MODEL" > "$tmp/rest" && (cd "$tmp" && split -a 2 -d -n 10 --numeric-suffixes=1 --additional-suffix=.bin rest '' && rm rest)
  for f in "$tmp"/[0-9][0-9].bin; do n=$(basename "$f" .bin); mkdir -p ".parts$n"; mv "$f" ".parts$n/"
    echo "$SHA model 11" > ".parts$n/SHA256SUMS"; done
fi
# The workflow's packages the GPU image lacks (pinned as pyproject.toml pins them; the rest resolved once, 2026-11-29).
WHEELS="snakemake==9.27.1 mlflow==3.17.2 math-verify==0.9.0 gguf==0.19.0 bitsandbytes==0.50.2 datasets==5.2.0
latex2sympy2-extended==1.11.0 mlflow-skinny==3.17.2 mlflow-tracing==3.17.2 trl==1.16.0 alembic==1.20.1
conda-inject==1.3.2 cryptography==50.0.2 dill==0.4.1 docker==7.2.0 docutils==0.22.4 dpath==2.2.0 flask==3.1.3
flask-cors==6.0.5 gitpython==3.2.1 graphene==3.4.3 gunicorn==26.2.0 huey==3.5.4 multiprocess==0.70.19 pulp==3.3.2
skops==0.16.0 smart-open==7.7.1 snakemake-interface-common==1.23.0 configargparse==1.9.0
snakemake-interface-executor-plugins==9.4.0 snakemake-interface-logger-plugins==2.1.0
snakemake-interface-report-plugins==1.3.0 snakemake-interface-scheduler-plugins==2.0.2
snakemake-interface-storage-plugins==4.4.1 humanfriendly==10.0 sqlmodel==0.0.37 sqlalchemy==2.0.58 tenacity==9.2.1
throttler==1.2.3 yte==1.9.4 immutables==0.21 jsonschema==4.26.0 referencing==0.37.0 nbformat==5.11.1
platformdirs==4.14.8 antlr4-python3-runtime==4.13.2 argparse-dataclass==2.0.0 blinker==1.9.0 cachetools==7.3.3
cffi==2.1.1 databricks-sdk==0.162.0 fastapi==0.165.0 fastjsonschema==2.22.3 gitdb==4.0.12 graphql-core==3.2.14
graphql-relay==3.2.0 greenlet==3.5.6 httpx2==2.16.2 httpcore2==2.16.2 importlib-metadata==9.1.0 itsdangerous==2.2.0
jsonschema-specifications==2025.9.1 jupyter-core==5.9.1 opentelemetry-api==1.45.2 opentelemetry-proto==1.45.2
opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 prettytable==3.18.0 pydantic==2.14.4
pydantic-core==2.50.5 python-dotenv==1.2.4 rpds-py==2026.9.1 sqlparse==0.6.1 starlette==1.10.0 traitlets==5.16.1
uvicorn==0.54.0 mako==1.4.3 annotated-types==0.8.0 google-auth==2.63.0 smmap==5.0.3 truststore==0.10.5
typing-inspection==0.4.5 wcwidth==0.9.4 pycparser==3.12 pyasn1-modules==0.4.2 pyasn1==0.6.5"
if [ ! -f .whl/.complete ]; then
  mkdir -p .whl
  plat=""; for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
      manylinux_2_34 manylinux_2_35; do plat="$plat --platform ${p}_x86_64"; done
  for w in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .whl "$w"
  done
  python3 -m pip wheel -q --no-deps -w .whl connection-pool==0.0.3   # an sdist only: pure Python, built here
  zip -q -d .whl/bitsandbytes-*.whl 'bitsandbytes/libbitsandbytes_cuda1[12]*.so' 'bitsandbytes/libbitsandbytes_cuda132.so' \
    'bitsandbytes/*rocm*'
  zip -q -d .whl/pulp-*.whl 'pulp/solverdir/*'
  zip -q -d .whl/mlflow-3*.whl 'mlflow/server/js/*'
  touch .whl/.complete
fi
du -sh .whl .parts00 .parts01 "$MODEL"
