#!/usr/bin/env bash
# A real single-node SLURM on this machine, for tests/workflow/test_slurm.py: munge, slurmctld and slurmd from
# Debian's packages (slurmctld slurmd slurm-client munge), started as root without systemd. Accounting storage is off
# (no slurmdbd), so the workflow asks job states with squeue (`slurm-status-command: squeue`) and a finished job stays
# listed for MinJobAge = 2 h. Idempotent: a second call with the daemons up only waits for the node.
#   bash .ci/slurm-localhost.sh          # install if missing (apt), configure, start; prints the partition name
set -euo pipefail
PARTITION=${QERL_SLURM_PARTITION:-debug}
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi
host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 2048 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=qerl-ci
SlurmctldHost=${host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=7200
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=${host} CPUs=${cpus} RealMemory=${mem_mb} State=UNKNOWN
PartitionName=${PARTITION} Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none;
                                 chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 60); do
    state=$(sinfo -h -n "$host" -o %t 2>/dev/null || true)
    case "$state" in idle*|mix*|alloc*) echo "$PARTITION"; exit 0 ;; esac
    [ "${state%\*}" = "down" ] || [ "${state%\*}" = "drain" ] && scontrol update nodename="$host" state=resume 2>/dev/null || true
    sleep 1
done
echo "slurm-localhost: node $host did not come up (state: ${state:-none}); see /var/log/slurm/" >&2
exit 1
