#!/usr/bin/env bash
# One device call: correctness of the NVFP4 kernels on the GPU, then tuning and/or the benchmark.
# Usage (on the GPU machine, repo root): bash scripts/gpu_kernels.sh OUT_DIR [quick|full|tune7b|decode|newgpu|tune|dq]
set -euo pipefail
OUT=${1:?out dir}; MODE=${2:-quick}
mkdir -p "$OUT" /tmp/qerl_pp
ln -sfn "$PWD/kernels" /tmp/qerl_pp/qerl_kernels     # the import name pyproject maps kernels/ to
export PYTHONPATH="$PWD:/tmp/qerl_pp${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m qerl_kernels.selfcheck $( [ "$MODE" = quick ] || [ "$MODE" = newgpu ] && echo --quick ) --json "$OUT/selfcheck.json" 2>&1 | tail -3
case "$MODE" in
  quick) python3 -c "
from pathlib import Path; from qerl.stages import bench_kernels as b
print(b.run(Path('$OUT'), models=('7B',), ms=(1, 16, 64, 2048), progress=False))" ;;
  full) python3 -m qerl.stages.bench_kernels --output "$OUT" --no-progress ;;
  tune7b) python3 -m qerl_kernels.tune --models 7B --ms 1 16 64 2048 --csv "$OUT/tune_7B.csv" --no-progress
          cp kernels/tuned/*.json "$OUT/"
          python3 -m qerl.stages.bench_kernels --output "$OUT" --models 7B --ms 1 4 16 64 256 2048 8192 --no-progress ;;
  decode) python3 -m qerl_kernels.tune --models 7B 32B --ms 1 4 16 64 --kinds fwd --csv "$OUT/tune_decode.csv" --no-progress
          cp kernels/tuned/*.json "$OUT/"
          python3 -m qerl.stages.bench_kernels --output "$OUT" --models 7B --ms 1 4 8 16 64 --no-progress ;;
  newgpu) # a first tuned table for another GPU inside one 10-minute call: decode paths, then tiles
          timeout 300 python3 -m qerl_kernels.tune --models 7B 32B --ms 1 16 --kinds fwd --csv "$OUT/tune_decode.csv" --no-progress || true
          timeout 150 python3 -m qerl_kernels.tune --models 7B 32B --ms 64 2048 --csv "$OUT/tune_tiles.csv" --no-progress || true
          cp kernels/tuned/*.json "$OUT/"
          timeout 60 python3 -m qerl.stages.bench_kernels --output "$OUT" --models 7B --ms 1 4 16 64 2048 --no-progress || true ;;
  dq) # add the dequantize + cuBLAS path (DQ) to the table: DQ windows vs the tuned Triton config, M >= 64
      timeout 330 python3 -m qerl_kernels.tune --paths dq --models 7B 14B 32B --ms 128 256 512 2048 8192 \
        --csv "$OUT/tune_dq.csv" --no-progress || true
      cp kernels/tuned/*.json "$OUT/"
      timeout 120 python3 -m qerl.stages.bench_kernels --output "$OUT" --models 7B --ms 1 16 64 256 2048 8192 --no-progress || true ;;
  tune) python3 -m qerl_kernels.tune --models 7B 14B 32B --ms 1 16 64 2048 --csv "$OUT/tune_all.csv" --no-progress
        cp kernels/tuned/*.json "$OUT/" ;;
esac
