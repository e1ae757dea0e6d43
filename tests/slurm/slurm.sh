#!/usr/bin/env bash
# A real two-node Slurm cluster on one machine for tests/slurm: the network namespaces and sshd of
# tests/cluster/netns.sh (pc-node0 = 10.77.0.1, pc-node1 = 10.77.0.2), Debian's munged, slurmctld in
# pc-node0's namespace and one slurmd per namespace, named after it (`slurmd -N pc-node0`), each with its own
# spool, log and pid file. No cgroups: proctrack/linuxproc, task/none. Root only; `up` is idempotent.
# Slurm's commands reach slurmctld from inside a node: `ip netns exec pc-node0 sbatch ...`.
#   bash tests/slurm/slurm.sh up|down|status
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/pidfile.sh
source "$HERE/../pidfile.sh"  # a pid file's number counts as the daemon only while it still is that daemon
NODES=(pc-node0 pc-node1)
ADDRS=(10.77.0.1 10.77.0.2)
RUN=/run/paco-slurm
CONF=$RUN/slurm.conf
# What a scheduler's stop gives the job before SIGKILL (KillWait): the ranks' preemption save
# (checkpoint.sigterm_grace_s, 25 s by default) and the launcher's own stop must fit in it.
KILL_WAIT=${PACO_SLURM_KILL_WAIT:-40}
HOSTS_MARK='# paco_ds slurm test nodes (tests/slurm/slurm.sh)'
SSH_MARK='# paco_ds slurm test nodes by name (tests/slurm/slurm.sh)'

# nsenter enters only the network namespace: `ip netns exec` would also remount /sys, without the
# cgroup mounts slurmd looks for at start (even with proctrack/linuxproc).
in_ns() { nsenter --net="/var/run/netns/$1" "${@:2}"; }

up() {
  PATH=$PATH:/usr/sbin
  bash "$HERE/../cluster/netns.sh" up
  mkdir -p "$RUN/state" "$RUN/log"
  # The node names resolve to the namespaces' addresses (slurmd -N, deepspeed's hostfile, ssh, pdsh).
  if ! grep -qF "$HOSTS_MARK" /etc/hosts; then
    printf '%s\n%s pc-node0\n%s pc-node1\n' "$HOSTS_MARK" "${ADDRS[0]}" "${ADDRS[1]}" >> /etc/hosts
  fi
  # netns.sh's ssh settings are for the addresses; the launcher reaches the nodes by name here.
  if ! grep -qF "$SSH_MARK" /root/.ssh/config; then
    awk '/^# paco_ds test cluster/{on=1; next} on && /^Host /{print; next} on && /^  /{print; next} {on=0}' \
      /root/.ssh/config | sed '1s/.*/Host pc-node0 pc-node1/' > "$RUN/ssh-block"
    { echo "$SSH_MARK"; cat "$RUN/ssh-block"; } >> /root/.ssh/config
  fi
  cat > "$CONF" <<CONF
ClusterName=paco-test
SlurmctldHost=$(hostname -s)(${ADDRS[0]})  # this machine's name (slurmctld checks it), node 0's address
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again cred_expire + 1 s after its requeue (default 120 s): short for tests.
AuthInfo=cred_expire=10
CredType=cred/munge
# No cgroups here: processes are tracked by their parentage, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
JobRequeue=1
KillWait=$KILL_WAIT
# Keep a finished job's record long enough for \`scontrol show job\` after the tests' runs.
MinJobAge=900
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
StateSaveLocation=$RUN/state
SlurmdSpoolDir=$RUN/spool-%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$RUN/log/slurmctld.log
SlurmdLogFile=$RUN/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName=pc-node0 NodeAddr=${ADDRS[0]} CPUs=2 RealMemory=4000 State=UNKNOWN
NodeName=pc-node1 NodeAddr=${ADDRS[1]} CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=test Nodes=pc-node[0-1] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
  ln -sf "$CONF" /etc/slurm/slurm.conf
  # munge: a key from the package, its run dir owned by munge, the daemon as munge.
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
  [ -f /etc/munge/munge.key ] || { dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
                                   chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
  if ! munge -n </dev/null >/dev/null 2>&1; then
    rm -f /run/munge/munged.pid.start
    runuser -u munge -- /usr/sbin/munged
    pidfile_note /run/munge/munged.pid munged || true
  fi
  for i in 0 1; do mkdir -p "$RUN/spool-${NODES[$i]}"; done
  if ! pidfile_pid "$RUN/slurmctld.pid" slurmctld >/dev/null; then
    rm -f "$RUN/slurmctld.pid" "$RUN/slurmctld.pid.start"  # its number may be another process's now
    in_ns pc-node0 /usr/sbin/slurmctld -f "$CONF" -i
    pidfile_note "$RUN/slurmctld.pid" slurmctld || true
  fi
  for i in 0 1; do
    pidf="$RUN/slurmd-${NODES[$i]}.pid"
    if pidfile_pid "$pidf" slurmd >/dev/null; then continue; fi
    rm -f "$pidf" "$pidf.start"
    in_ns "${NODES[$i]}" /usr/sbin/slurmd -f "$CONF" -N "${NODES[$i]}"
    pidfile_note "$pidf" slurmd || true
  done
  # Ready when both nodes are idle (a deadline, not a sleep standing in for it).
  for _ in $(seq 120); do
    if [ "$(in_ns pc-node0 sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$')" = 2 ]; then
      echo "slurm up: pc-node0 (slurmctld, slurmd) and pc-node1 (slurmd), KillWait=${KILL_WAIT}s; config $CONF"
      return 0
    fi
    sleep 0.5
  done
  echo "slurm did not come up: sinfo says:" >&2
  in_ns pc-node0 sinfo -N >&2 || true
  tail -n 20 "$RUN"/log/*.log >&2 || true
  exit 1
}

down() {
  if pidfile_pid "$RUN/slurmctld.pid" slurmctld >/dev/null; then
    # Whatever still runs: cancelled, so no job's process outlives the cluster.
    in_ns pc-node0 scancel -p test 2>/dev/null || true
  fi
  # stop_pidfile (tests/pidfile.sh): SIGTERM, SIGKILL after 10 s, each only while the pid is still the daemon
  for n in "${NODES[@]}"; do stop_pidfile "$RUN/slurmd-$n.pid" slurmd; done
  stop_pidfile "$RUN/slurmctld.pid" slurmctld
  if [ -f /run/munge/munged.pid ]; then stop_pidfile /run/munge/munged.pid munged; fi
  awk -v mark="$HOSTS_MARK" '$0==mark{skip=2; next} skip>0{skip--; next} {print}' /etc/hosts > "$RUN/hosts" \
    && cat "$RUN/hosts" > /etc/hosts
  if [ -f /root/.ssh/config ]; then
    awk -v mark="$SSH_MARK" '$0==mark{skip=1; next} skip && (/^Host / || /^  /){next} {skip=0; print}' \
      /root/.ssh/config > "$RUN/ssh-config" && cat "$RUN/ssh-config" > /root/.ssh/config
  fi
  [ "$(readlink /etc/slurm/slurm.conf 2>/dev/null)" = "$CONF" ] && rm -f /etc/slurm/slurm.conf
  rm -rf "$RUN"
  bash "$HERE/../cluster/netns.sh" down
  echo "slurm down"
}

status() {
  bash "$HERE/../cluster/netns.sh" status
  in_ns pc-node0 sinfo -N 2>/dev/null || echo "slurmctld not reachable"
}

"${1:-up}"
