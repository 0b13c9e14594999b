#!/usr/bin/env bash
# GPU: why the register-fragment decode kernel (nvfp4_mmv) slows down with more activation rows per
# program: ncu stall reasons (per issued instruction), pipe utilisation and DRAM throughput of one
# launch per (M, config) on Qwen2.5-7B gate/up (37888 x 3584).
#   bash scripts/ncu_decode_stalls.sh OUT.txt
set -euo pipefail
out=${1:?usage: ncu_decode_stalls.sh OUT.txt}
S=smsp__average_warps_issue_stalled_
R=_per_issue_active.ratio
metrics=""
for s in long_scoreboard short_scoreboard math_pipe_throttle mio_throttle lg_throttle wait not_selected selected \
         dispatch_stall no_instruction barrier tex_throttle drain imc_miss branch_resolving membar sleeping; do
  metrics+="${S}${s}${R},"
done
metrics+="sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active"
metrics+=",sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active"
metrics+=",smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__throughput.avg.pct_of_peak_sustained_active"
metrics+=",l1tex__data_bank_conflicts_pipe_lsu.sum,smsp__warps_active.avg.per_cycle_active,smsp__inst_executed.sum"
metrics+=",dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,launch__registers_per_thread"
: > "$out"
for m in 1 16 32; do
  bm=$(( m < 8 ? 8 : m ))
  cfg="{\"MMV\":1,\"BM\":$bm,\"BN\":64,\"BK\":128,\"SPLIT\":1,\"num_warps\":4,\"num_stages\":1,\"XPRE\":0}"
  echo "=== M=$m $cfg" | tee -a "$out"
  QERL_KERNEL_CONFIG="$cfg" ncu --clock-control none -k regex:nvfp4 -c 1 --metrics "$metrics" \
    python3 scripts/profile_decode.py 37888 3584 "$m" 2>&1 | grep -E "^\s+(smsp|sm__|l1tex|dram|gpu__|launch)" \
    | sed -e "s/$S//" -e "s/$R//" | awk '{print $1, $NF}' | tee -a "$out"
done
