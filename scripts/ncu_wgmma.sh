#!/usr/bin/env bash
# GPU: where the warpgroup-MMA kernel's time goes at M = 64 (nvfp4_wgmma, the routed configs): ncu's
# speed-of-light (SM / memory / L2 / DRAM throughput), warp-state stalls, occupancy and memory workload
# sections for one launch per shape (7B gate/up 37888 x 3584, 7B o 3584 x 3584, 32B down 5120 x 27648),
# each with its tuned config and with two alternatives (BT 32; 3 vs 2 ring stages).
#   bash scripts/ncu_wgmma.sh OUT.txt
set -uo pipefail
out=${1:?usage: ncu_wgmma.sh OUT.txt}
: > "$out"
run() {  # N K M config-json
  echo "=== N=$1 K=$2 M=$3 ${4:-tuned}" | tee -a "$out"
  QERL_KERNEL_CONFIG="${4:-{\}}" ncu --clock-control none -k regex:wgmma -c 1 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    python3 scripts/profile_decode.py "$1" "$2" "$3" 2>&1 | grep -vE "^==PROF==|Warning|^\s*$|^\s+-+" \
    | grep -E "Duration|Throughput|Busy|Stall|Occupancy|Registers|Shared Memory Config|Block Limit|Warp Cycles|Issued|Eligible|Active Warps|L2 Hit|L1/TEX Hit|Mem Pipes|Max Bandwidth|Memory \[%\]|Grid Size|Waves" \
    | tee -a "$out"
}
run 37888 3584 64
run 37888 3584 64 '{"WGMMA":1,"WG":1,"BT":32,"NS":3,"SPLIT":1,"XG":0}'
run 37888 3584 64 '{"WGMMA":1,"WG":1,"BT":64,"NS":2,"SPLIT":1,"XG":0}'
run 3584 3584 64
run 3584 3584 64 '{"WGMMA":1,"WG":1,"BT":64,"NS":3,"SPLIT":4,"XG":0}'
run 5120 27648 64
