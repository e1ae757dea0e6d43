# Pid files of the test lanes' daemons (sshd, slurmctld, slurmd, munged), sourced by
# tests/cluster/netns.sh and tests/slurm/slurm.sh. A pid file outlives its daemon, and its number may
# since belong to another process: a pid counts as the daemon's only while /proc/<pid>/comm names the
# daemon and its start time (ticks since boot, field 22 of /proc/<pid>/stat) is the one
# `pidfile_note` wrote beside the pid file (<file>.start) when the daemon started or, without that
# note, no later than the pid file was written. Anything else is "not running": nothing is signalled.
#   source tests/pidfile.sh
#   pidfile_pid FILE NAME    # prints the daemon's pid; fails if FILE names no live NAME of its own
#   pidfile_note FILE NAME   # after starting the daemon: wait for its pid file, note its start time
#   stop_pidfile FILE NAME   # SIGTERM, SIGKILL after 10 s, each only while the pid is still the daemon's

# The start ticks of a running process (not a zombie); fails if there is none.
_pid_start_ticks() {
  local s
  s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  s=${s##*") "}  # after the command name, which may hold spaces
  # shellcheck disable=SC2086
  set -- $s
  [ "$1" != Z ] && [ -n "${20:-}" ] && echo "${20}"
}

# Whether pid $1 is still the process that started at ticks $2.
_pid_is() { [ -n "$2" ] && [ "$(_pid_start_ticks "$1")" = "$2" ]; }

pidfile_pid() {
  local pidf=$1 name=$2 pid="" rest comm ticks want btime hz written
  [ -f "$pidf" ] || return 1
  read -r pid rest < "$pidf" || [ -n "$pid" ] || return 1
  [[ $pid =~ ^[0-9]+$ ]] && [ "$pid" -gt 1 ] || return 1
  comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
  [ "$comm" = "${name:0:15}" ] || return 1  # the kernel keeps 15 characters of it
  ticks=$(_pid_start_ticks "$pid") || return 1
  if [ -f "$pidf.start" ]; then
    read -r want < "$pidf.start" || [ -n "${want:-}" ] || return 1
    [ "$ticks" = "$want" ] || return 1
  else
    # It wrote the file, so it started before it; a process that took the number later did not.
    # (btime is whole seconds and may jitter by one: one second of slack.)
    btime=$(awk '$1 == "btime" {print $2}' /proc/stat)
    hz=$(getconf CLK_TCK)
    written=$(stat -c %Y "$pidf")
    [ $((btime + ticks / hz)) -le $((written + 1)) ] || return 1
  fi
  echo "$pid"
}

pidfile_note() {
  local pidf=$1 name=$2 pid ticks
  rm -f "$pidf.start"
  for _ in $(seq 100); do
    if pid=$(pidfile_pid "$pidf" "$name") && ticks=$(_pid_start_ticks "$pid"); then
      echo "$ticks" > "$pidf.start"
      return 0
    fi
    sleep 0.1
  done
  echo "$name: no live process in its pid file $pidf after 10 s" >&2
  return 1
}

stop_pidfile() {
  local pidf=$1 name=$2 pid ticks
  if pid=$(pidfile_pid "$pidf" "$name") && ticks=$(_pid_start_ticks "$pid"); then
    if _pid_is "$pid" "$ticks"; then kill "$pid" 2>/dev/null || true; fi
    for _ in $(seq 50); do _pid_is "$pid" "$ticks" || break; sleep 0.2; done
    if _pid_is "$pid" "$ticks"; then kill -9 "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$pidf" "$pidf.start"
}
