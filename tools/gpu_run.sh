#!/usr/bin/env bash
# Run a workflow config on a bare, offline GPU machine whose Python lacks the workflow's packages (the device
# machines of this project: torch / transformers / peft there, no snakemake, mlflow, math-verify, gguf, no network,
# at most 64 MiB carried per call). Each call:
#   1. installs the wheels carried in .whl/ (once per machine; python3 -m pip download ... as the device notes say),
#   2. files the GGUF parts carried in .parts/ (NN.bin + SHA256SUMS of the whole file) and, once all are there,
#      joins them into the model file the config names (checked against its sha256),
#   3. runs `snakemake --cores all --configfile CONFIG` for at most BUDGET seconds (a run cut short resumes at the
#      next call: training jobs continue from their last checkpoint, finished jobs are not redone),
#   4. packs what came out under $OUT: ${TAG}results.tgz (metrics, summaries, evaluations, samples) and
#      ${TAG}logs.tgz (job logs, snakemake's, GPU use every 15 s, the MLflow store).
# usage: bash tools/gpu_run.sh "CONFIG [OVERLAY...]" BUDGET_S [MODEL_FILE]
# Environment: SNAKEMAKE_ARGS  targets / more snakemake options;
#              WORKDIR         run in this copy of the repository (made once; the model file linked), so that a second
#                              configuration can run beside the first (snakemake locks its directory);
#              TAG             prefix of the files written under $OUT (two runs side by side);
#              QERL_MPS=1      start NVIDIA's Multi-Process Service once per machine, so that the kernels of the jobs
#                              sharing a GPU (resources.jobs_per_gpu) run side by side instead of time-sliced.
set -uo pipefail
CONFIG=${1:?config file(s), space-separated}; BUDGET=${2:?seconds}; MODEL=${3:-}
SITE=/tmp/qerl-site; PARTS=/tmp/qerl-parts; OUT=${OUT:-/tmp/qerl-out}; TAG=${TAG:-}
mkdir -p "$SITE" "$PARTS" "$OUT"
if [ "${QERL_MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/qerl-mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/qerl-mps/log
  if ! pgrep -f nvidia-cuda-mps-control >/dev/null; then
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY" && nvidia-cuda-mps-control -d && echo "MPS started"
  fi
fi
if [ -n "${WORKDIR:-}" ]; then
  if [ ! -d "$WORKDIR" ]; then
    mkdir -p "$WORKDIR" && git ls-files -z | xargs -0 cp --parents -t "$WORKDIR" && cp -a .whl "$WORKDIR"/ 2>/dev/null
  fi
  [ -n "$MODEL" ] && mkdir -p "$WORKDIR/$(dirname "$MODEL")" && ln -sfn "$PWD/$MODEL" "$WORKDIR/$MODEL"
  cd "$WORKDIR" || exit 1
fi
ROOT=$PWD
if [ -d .whl ] && [ ! -f "$SITE/.installed" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    && touch "$SITE/.installed" || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH="$ROOT:$SITE" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for d in .parts*/; do [ -d "$d" ] && cp -f "$d"* "$PARTS/"; done
if [ -n "$MODEL" ] && [ ! -f "$MODEL" ]; then
  want=$(awk '{print $1}' "$PARTS/SHA256SUMS" 2>/dev/null); have=$(ls "$PARTS"/*.bin 2>/dev/null | wc -l)
  need=$(awk '{print $3}' "$PARTS/SHA256SUMS" 2>/dev/null)
  echo "model parts here: $have of ${need:-?}"
  if [ -n "$need" ] && [ "$have" -ge "$need" ]; then
    mkdir -p "$(dirname "$MODEL")" && cat "$PARTS"/*.bin > "$MODEL.tmp"
    got=$(sha256sum "$MODEL.tmp" | awk '{print $1}')
    if [ "$got" = "$want" ]; then mv "$MODEL.tmp" "$MODEL"; echo "joined $MODEL ($got)"; else
      echo "joined file's sha256 $got != $want"; rm -f "$MODEL.tmp"; exit 1; fi
  else exit 0; fi
fi
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
python3 -c "import torch, transformers, peft, snakemake, mlflow; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'peft', peft.__version__, 'snakemake', snakemake.__version__, 'mlflow', mlflow.__version__)"
mkdir -p logs
(while sleep 15; do date +%T; nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader; done) \
  >> logs/gpu_util.log 2>&1 &
timeout --signal=INT --kill-after=60 "$BUDGET" python3 -m snakemake --cores all --configfile $CONFIG \
  --rerun-incomplete --keep-going --scheduler greedy --printshellcmds ${SNAKEMAKE_ARGS:-}
echo "snakemake exit $?"
kill %1 2>/dev/null
tar czf "$OUT/${TAG}results.tgz" --exclude='results/models' --exclude='results/base_models' --exclude='results/quantize/*/*.safetensors' \
  --exclude='results/quantize/*/tokenizer*' \
  --exclude='*/checkpoint' --exclude='*/final/*.safetensors' --exclude='results/mlflow*' results 2>/dev/null
tar czf "$OUT/${TAG}logs.tgz" logs .snakemake/log $(ls results/mlflow.db 2>/dev/null) 2>/dev/null  # (+ the MLflow store)
ls -la "$OUT"
