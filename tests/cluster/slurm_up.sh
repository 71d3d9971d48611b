#!/usr/bin/env bash
# A two-node Slurm cluster on this one machine, for the tests: slurmctld plus two slurmd (n1, n2) on
# loopback, each on its own port, node names resolving to 127.0.0.1. Idempotent: installs Debian's
# slurm-wlm and munge when missing, starts only what is not running, and returns once `sinfo` shows
# both nodes idle (exit 1 with the daemons' logs after a timeout). Installing and starting need root and
# apt-get: when this machine cannot have the cluster (not root and it is not already up, no apt-get, the
# install fails, or munged/slurmctld/slurmd are refused for lack of permission) it exits 2 with the reason on
# stderr, which the tests report as a skip; any other failure is exit 1.
#
#   tests/cluster/slurm_up.sh            # prints the config path: export SLURM_CONF=/tmp/paratrain-slurm/slurm.conf
#   tests/cluster/slurm_up.sh --down     # stop slurmctld, the two slurmd, and munged if this script started it
#
# Each daemon it starts is named on stderr ("slurm_up: started slurmctld"): the tests stop the cluster when they
# end only if they started it (tests/test_slurm.py).
#
# Everything lives under $PARATRAIN_SLURM_DIR (default /tmp/paratrain-slurm); no file under /etc/slurm is
# touched, so a real Slurm installation on the machine is left alone.
set -euo pipefail

DIR=${PARATRAIN_SLURM_DIR:-/tmp/paratrain-slurm}
CTLD_PORT=${PARATRAIN_SLURM_PORT:-16817}  # n1 and n2 listen on the next two ports
TIMEOUT_S=${PARATRAIN_SLURM_TIMEOUT:-60}
export SLURM_CONF=$DIR/slurm.conf

say() { echo "slurm_up: $*" >&2; }
logs() { for log in "$DIR"/*.log; do [ -f "$log" ] && { say "--- $log"; tail -n 20 "$log" >&2; }; done; return 0; }
fail() { say "$*"; logs; exit 1; }
unavailable() { say "$*"; exit 2; }  # this machine cannot have the cluster: not a bug to report
REFUSED='permission denied|operation not permitted'

running() {  # running PIDFILE: the daemon whose pid the file names is alive
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

nodes_up() {  # both nodes answering (idle, or busy with another test's job); their states in $states
  states=$(sinfo -h -N -o '%N=%t' 2>/dev/null | sort -u | tr '\n' ' ' || true)
  [[ "$states" =~ n1=(idle|mix|alloc) && "$states" =~ n2=(idle|mix|alloc) ]]
}

start() {  # start NAME COMMAND...: a daemon's start command; a refusal for lack of permission exits 2
  # 9>&-: the daemons must not inherit (and so hold forever) this script's lock
  "${@:2}" >"$DIR/$1.start" 2>&1 9>&- && { say "started $1"; return 0; }
  if grep -qiE "$REFUSED" "$DIR/$1.start"; then unavailable "$1 cannot be started here: $(cat "$DIR/$1.start")"; fi
  fail "$1 did not start: $(cat "$DIR/$1.start")"
}

stop_all() {
  local pidfile pids=()
  for pidfile in "$DIR"/slurmd-n1.pid "$DIR"/slurmd-n2.pid "$DIR"/slurmctld.pid; do
    if running "$pidfile"; then pids+=("$(cat "$pidfile")"); fi
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  stop_pids "${pids[@]}"
}

stop_pids() {  # SIGTERM, then SIGKILL after 10 s
  kill "$@" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$@" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$@" 2>/dev/null || true
}

install_packages() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
  command -v apt-get >/dev/null || unavailable "slurm-wlm and munge are not installed and there is no apt-get"
  say "installing slurm-wlm and munge"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -q slurm-wlm munge >"$DIR/apt.log" 2>&1; then
    { apt-get update -q && apt-get install -y -q slurm-wlm munge; } >"$DIR/apt.log" 2>&1 ||
      unavailable "apt-get could not install slurm-wlm and munge: $(tail -n 5 "$DIR/apt.log")"
  fi
}

write_config() {
  mkdir -p "$DIR/state" "$DIR/spool"
  local host
  host=$(hostname -s)
  cat >"$DIR/slurm.conf.new" <<EOF
# written by tests/cluster/slurm_up.sh: two nodes on loopback for paratrain's tests
ClusterName=paratrain
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName=n1 NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 1)) CPUs=8 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=$((CTLD_PORT + 2)) CPUs=8 State=UNKNOWN
PartitionName=main Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
  if ! cmp -s "$DIR/slurm.conf.new" "$SLURM_CONF"; then
    stop_all  # daemons started with another configuration
    mv "$DIR/slurm.conf.new" "$SLURM_CONF"
  else
    rm "$DIR/slurm.conf.new"
  fi
}

name_nodes() {  # n1 and n2 must resolve, to loopback: they are the rendezvous hosts jobs see
  for node in n1 n2; do
    getent hosts "$node" >/dev/null || echo "127.0.0.1 $node" 2>/dev/null >>/etc/hosts ||
      unavailable "cannot name node $node: /etc/hosts is not writable here"
  done
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  { mkdir -p /run/munge && chown munge:munge /run/munge && chmod 0755 /run/munge; } 2>"$DIR/munge.start" ||
    unavailable "cannot prepare /run/munge for munged: $(cat "$DIR/munge.start")"
  [ -f /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || /usr/sbin/create-munge-key -f; chown munge:munge /etc/munge/munge.key; }
  start munged runuser -u munge -- /usr/sbin/munged --force
  munge -n </dev/null | unmunge >/dev/null || fail "munged does not answer"
  # ours to stop with --down (a munged that was already running serves others too, and is left alone)
  if [ -f /run/munge/munged.pid ]; then cp /run/munge/munged.pid "$DIR/munged.pid"; else pgrep -n -x munged >"$DIR/munged.pid" || true; fi
}

stop_munge() {  # the munged this script started, if any
  running "$DIR/munged.pid" && stop_pids "$(cat "$DIR/munged.pid")"
  rm -f "$DIR/munged.pid"
}

start_slurm() {
  running "$DIR/slurmctld.pid" || start slurmctld slurmctld -f "$SLURM_CONF"
  for node in n1 n2; do
    running "$DIR/slurmd-$node.pid" || start "slurmd-$node" slurmd -f "$SLURM_CONF" -N "$node"
  done
}

wait_idle() {
  local deadline=$((SECONDS + TIMEOUT_S)) pidfile
  states=""
  while [ $SECONDS -lt $deadline ]; do
    nodes_up && return 0
    case "$states" in *down*|*drain*) scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1 || true ;; esac
    sleep 0.5
  done
  for pidfile in "$DIR"/slurmctld.pid "$DIR"/slurmd-n1.pid "$DIR"/slurmd-n2.pid; do  # a daemon that died refused
    if ! running "$pidfile" && grep -qiE "$REFUSED" "${pidfile%.pid}.log" 2>/dev/null; then
      unavailable "$(basename "${pidfile%.pid}") cannot run here: $(grep -iE "$REFUSED" "${pidfile%.pid}.log" | tail -n 3)"
    fi
  done
  fail "nodes not idle after ${TIMEOUT_S}s (sinfo: ${states:-no answer})"
}

if [ "$(id -u)" != 0 ]; then  # the daemons run as root: another user can only use a cluster root started
  command -v sinfo >/dev/null || unavailable "slurm-wlm and munge are not installed and this is not root: cannot install them"
  [ "${1:-}" != "--down" ] || unavailable "only root can stop the test cluster"
  nodes_up || unavailable "the test cluster is not running and only root can start its daemons (this is uid $(id -u))"
  echo "$SLURM_CONF"
  exit 0
fi
exec 9>/tmp/paratrain-slurm.lock
flock -w "$TIMEOUT_S" 9 || { say "another slurm_up.sh holds /tmp/paratrain-slurm.lock"; exit 1; }
if [ "${1:-}" = "--down" ]; then stop_all; stop_munge; exit 0; fi
mkdir -p "$DIR"
install_packages
write_config
name_nodes
start_munge
start_slurm
wait_idle
echo "$SLURM_CONF"
