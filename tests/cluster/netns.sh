#!/usr/bin/env bash
# Two real "nodes" on one machine for tests/cluster: network namespaces pc-node0 (10.77.0.1) and
# pc-node1 (10.77.0.2) joined by a veth pair (named pceth on both sides, for GLOO_SOCKET_IFNAME),
# each with its own sshd that takes root's dedicated key only. Root only; `up` is idempotent.
#   bash tests/cluster/netns.sh up|down|status
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/pidfile.sh
source "$HERE/../pidfile.sh"  # a pid file's number counts as sshd only while it still is that sshd
KEY=/root/.ssh/paco_cluster_ed25519
NODES=(pc-node0 pc-node1)
ADDRS=(10.77.0.1 10.77.0.2)
RUN=/run/paco-cluster

up() {
  command -v sshd >/dev/null || PATH=$PATH:/usr/sbin
  mkdir -p /root/.ssh "$RUN" && chmod 700 /root/.ssh
  [ -f "$KEY" ] || ssh-keygen -q -t ed25519 -N '' -f "$KEY"
  touch /root/.ssh/authorized_keys && chmod 600 /root/.ssh/authorized_keys
  grep -qF "$(cat "$KEY.pub")" /root/.ssh/authorized_keys || cat "$KEY.pub" >> /root/.ssh/authorized_keys
  if ! grep -q '^# paco_ds test cluster' /root/.ssh/config 2>/dev/null; then
    printf '%s\n' '# paco_ds test cluster (tests/cluster/netns.sh)' 'Host 10.77.0.*' "  IdentityFile $KEY" \
      '  IdentitiesOnly yes' '  StrictHostKeyChecking no' '  UserKnownHostsFile /dev/null' '  LogLevel ERROR' \
      '  BatchMode yes' >> /root/.ssh/config
    chmod 600 /root/.ssh/config
  fi
  ssh-keygen -A >/dev/null
  mkdir -p /run/sshd
  if ! ip netns list | grep -qw pc-node0; then
    ip netns add pc-node0; ip netns add pc-node1
    ip link add pc-veth0 type veth peer name pc-veth1
    for i in 0 1; do
      ip link set "pc-veth$i" netns "${NODES[$i]}"
      ip -n "${NODES[$i]}" link set "pc-veth$i" name pceth
      ip -n "${NODES[$i]}" addr add "${ADDRS[$i]}/24" dev pceth
      ip -n "${NODES[$i]}" link set pceth up
      ip -n "${NODES[$i]}" link set lo up
    done
  fi
  for i in 0 1; do
    pidf="$RUN/sshd-$i.pid"
    if pidfile_pid "$pidf" sshd >/dev/null; then continue; fi
    rm -f "$pidf" "$pidf.start"  # a daemon that died long ago: its number may be another process's now
    cat > "$RUN/sshd-$i.conf" <<CONF
ListenAddress ${ADDRS[$i]}
PidFile $pidf
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
UsePAM no
AcceptEnv none
CONF
    ip netns exec "${NODES[$i]}" "$(command -v sshd)" -f "$RUN/sshd-$i.conf"
    pidfile_note "$pidf" sshd || true  # without the note, its pid file's time still tells
  done
  for a in "${ADDRS[@]}"; do
    ip netns exec pc-node0 ssh "$a" true || { echo "ssh to $a failed" >&2; exit 1; }
  done
  echo "test cluster up: pc-node0=10.77.0.1 pc-node1=10.77.0.2 (ssh key $KEY)"
}

down() {
  for i in 0 1; do
    stop_pidfile "$RUN/sshd-$i.pid" sshd
  done
  for n in "${NODES[@]}"; do ip netns del "$n" 2>/dev/null || true; done
  echo "test cluster down"
}

status() { for n in "${NODES[@]}"; do echo "$n: $(ip netns pids "$n" 2>/dev/null | tr '\n' ' ')"; done; }

"${1:-up}"
