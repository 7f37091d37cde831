#!/usr/bin/env bash
# One-node Slurm 22.05 cluster with accounting (slurmdbd + MariaDB) on localhost, for the
# SLURM tests and for trying the slurm profile on one machine. No systemd: every daemon is
# started by hand, and everything (config, state, logs, sockets, fake GPU devices) lives
# under one directory, so that `purge` removes it all. The one thing outside: symbolic links
# /etc/slurm/slurm.conf and gres.conf to this cluster's files (srun inside jobs reads those).
#
#   .ci/slurm-cluster.sh start    start what is not running, wait until the node is idle
#                                 and sacct answers, print the time it took
#   .ci/slurm-cluster.sh stop     cancel every job, then stop slurmd, slurmctld, slurmdbd,
#                                 MariaDB and munged (TERM, then KILL after a grace period)
#   .ci/slurm-cluster.sh status   one line per daemon, then sinfo; exit 0 only when all run
#   .ci/slurm-cluster.sh env      print `export SLURM_CONF=...` (eval it to use sinfo & co.)
#   .ci/slurm-cluster.sh purge    stop, then delete the cluster directory
#
# Environment (all optional):
#   VIDLABEL_SLURM_DIR        cluster directory                      [/tmp/vidlabel-slurm]
#   VIDLABEL_SLURM_GPUS       fake GPUs on the node                  [8]
#   VIDLABEL_SLURM_CPUS       CPUs the node advertises               [128]
#   VIDLABEL_SLURM_MEM_MB     memory the node advertises (MB)        [1000000]
#   VIDLABEL_SLURM_ACCOUNT    account created for the users          [vidlabel]
#   VIDLABEL_SLURM_PARTITION  name of the (default) partition        [gpu]
#   VIDLABEL_SLURM_USERS      users added to the account             [root and $SUDO_USER]
#   VIDLABEL_SLURM_DB_PORT    MariaDB TCP port on 127.0.0.1          [3306]
#   VIDLABEL_SLURM_PORTS      slurmctld,slurmd,slurmdbd ports        [6817,6818,6819]
#   VIDLABEL_SLURM_TIMEOUT_S  how long `start` waits for each step   [60]
#
# The node advertises more CPUs, memory and GPUs than the machine has (config_overrides and
# fake GPU character devices): enough for two 4-GPU shard jobs with realistic CPU and memory
# requests to run side by side, which is what the co-location test needs.
set -euo pipefail

DIR=${VIDLABEL_SLURM_DIR:-/tmp/vidlabel-slurm}
GPUS=${VIDLABEL_SLURM_GPUS:-8}
CPUS=${VIDLABEL_SLURM_CPUS:-128}
MEM_MB=${VIDLABEL_SLURM_MEM_MB:-1000000}
ACCOUNT=${VIDLABEL_SLURM_ACCOUNT:-vidlabel}
PARTITION=${VIDLABEL_SLURM_PARTITION:-gpu}
USERS=${VIDLABEL_SLURM_USERS:-root${SUDO_USER:+ $SUDO_USER}}
DB_PORT=${VIDLABEL_SLURM_DB_PORT:-3306}
IFS=, read -r CTLD_PORT SLURMD_PORT DBD_PORT <<<"${VIDLABEL_SLURM_PORTS:-6817,6818,6819}"
TIMEOUT_S=${VIDLABEL_SLURM_TIMEOUT_S:-60}
CLUSTER=vidlabel
NODE=localhost

ETC=$DIR/etc
LOG=$DIR/log
RUN=$DIR/run
MUNGE_DIR=$DIR/munge          # key, pid, seed, log: owned by munge, private
MUNGE_SOCK_DIR=$DIR/munge-run # socket: reachable by every client
MUNGE_SOCK=$MUNGE_SOCK_DIR/munge.socket.2
DB_DIR=$DIR/mariadb
DB_SOCK=$DB_DIR/run/mysqld.sock
DB_PASS_FILE=$ETC/db.password
export SLURM_CONF=$ETC/slurm.conf

PACKAGES=(munge slurmctld slurmd slurmdbd slurm-client mariadb-server)

log() { printf '[slurm-cluster] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# ---------------------------------------------------------------------------- helpers

# pid_alive PIDFILE NAME: the pid in PIDFILE runs a program called NAME
# (comparing the name guards against a stale pid file whose pid was reused).
pid_alive() {
    local pidfile=$1 name=$2 pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/$pid/comm ]] || return 1
    [[ $(</proc/"$pid"/comm) == "$name"* ]]
}

# wait_for SECONDS DESCRIPTION COMMAND...: retry COMMAND every 0.2 s until it succeeds.
wait_for() {
    local seconds=$1 what=$2 deadline
    shift 2
    deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            log "timed out after ${seconds}s waiting for: $what"
            return 1
        fi
        sleep 0.2
    done
}

# stop_pid PIDFILE NAME: TERM the daemon, KILL it if it is still there after 15 s.
stop_pid() {
    local pidfile=$1 name=$2 pid i
    if ! pid_alive "$pidfile" "$name"; then
        rm -f "$pidfile"
        return 0
    fi
    pid=$(<"$pidfile")
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 75; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "$name did not stop in 15 s, sending KILL"
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
    fi
    rm -f "$pidfile"
}

port_in_use() { ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }

check_platform() {
    [[ $(id -u) -eq 0 ]] || die "must run as root (daemons run as root, munge and mysql users)"
    [[ -r /etc/debian_version ]] || die "needs Debian (packages: ${PACKAGES[*]})"
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if ((${#missing[@]})); then
        log "installing ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# ---------------------------------------------------------------------------- configuration

write_config() {
    mkdir -p "$ETC" "$LOG" "$RUN" "$DIR/state/ctld" "$DIR/state/slurmd" "$DIR/dev"
    chmod 0755 "$DIR"

    # Fake GPUs: slurmd drops a gpu gres whose File= does not exist (the node turns INVAL).
    # Any character device will do; /dev/null's numbers (1,3) are harmless.
    local i
    for ((i = 0; i < GPUS; i++)); do
        [[ -c $DIR/dev/nvidia$i ]] && continue
        rm -f "$DIR/dev/nvidia$i"
        mknod "$DIR/dev/nvidia$i" c 1 3 2>/dev/null || ln -s /dev/null "$DIR/dev/nvidia$i"
    done

    if [[ ! -s $DB_PASS_FILE ]]; then
        (umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$DB_PASS_FILE")
    fi

    cat >"$ETC/slurm.conf" <<EOF
# Generated by .ci/slurm-cluster.sh: one-node cluster on localhost with accounting.
ClusterName=$CLUSTER
SlurmctldHost=$NODE
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
StateSaveLocation=$DIR/state/ctld
SlurmdSpoolDir=$DIR/state/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MpiDefault=none
SwitchType=switch/none
# No cgroups here: track processes through /proc, no task containment.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Allocate cores, memory and GPUs, so that several jobs share the node; without a
# default memory per CPU one job would take all of the node's memory.
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
GresTypes=gpu
# Believe the node line below rather than the hardware (the machine has 2 cores).
SlurmdParameters=config_overrides
# Keep finished jobs visible to squeue for 5 minutes.
MinJobAge=300
# A node that comes back (slurmd restarted) returns to service by itself.
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
# Time limit: SIGTERM first, SIGKILL KillWait seconds later (as on most clusters).
KillWait=30
SchedulerType=sched/backfill
# Accounting through slurmdbd, so that sacct (the executor plugin's status command) works
# and shows the GPUs each job was given.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$NODE
AccountingStoragePort=$DBD_PORT
# For connections to slurmdbd this names the munge socket (AuthInfo is not used there).
AccountingStoragePass=$MUNGE_SOCK
AccountingStorageTRES=gres/gpu
AccountingStorageEnforce=associations
# Keep the job comment (the executor plugin writes the rule and wildcards there) for sacct.
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:$GPUS State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

    {
        echo "# Generated by .ci/slurm-cluster.sh: fake GPU devices (see slurm.conf)."
        for ((i = 0; i < GPUS; i++)); do
            echo "NodeName=$NODE Name=gpu File=$DIR/dev/nvidia$i"
        done
    } >"$ETC/gres.conf"

    (
        umask 077
        cat >"$ETC/slurmdbd.conf" <<EOF
# Generated by .ci/slurm-cluster.sh.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$NODE
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(<"$DB_PASS_FILE")
StorageLoc=slurm_acct_db
EOF
    )

    # Anyone may read the cluster config (sinfo, sbatch as any user); the database password
    # lives only in slurmdbd.conf and db.password, which stay private to root.
    chmod 0644 "$ETC/slurm.conf" "$ETC/gres.conf"
    echo "export SLURM_CONF=$ETC/slurm.conf" >"$DIR/env"
    link_system_config
}

# Inside a job, the Snakemake job step drops every SLURM_* variable (SLURM_CONF included) before
# it calls srun, so srun reads the compiled-in /etc/slurm/slurm.conf, as on any real cluster.
# Link it to this cluster's config, unless it is another cluster's real file.
link_system_config() {
    local f target
    mkdir -p /etc/slurm
    for f in slurm.conf gres.conf; do
        target=$(readlink "/etc/slurm/$f" 2>/dev/null || true)
        if [[ -e /etc/slurm/$f && ! -L /etc/slurm/$f ]]; then
            die "/etc/slurm/$f belongs to another cluster; jobs would not find this one's config"
        fi
        if [[ $target != "$ETC/$f" ]]; then
            [[ -z $target ]] || log "relinking /etc/slurm/$f (was $target)"
            ln -sfn "$ETC/$f" "/etc/slurm/$f"
        fi
    done
}

unlink_system_config() {
    local f
    for f in slurm.conf gres.conf; do
        if [[ -L /etc/slurm/$f && $(readlink "/etc/slurm/$f") == "$ETC/$f" ]]; then
            rm -f "/etc/slurm/$f"
        fi
    done
}

# ---------------------------------------------------------------------------- daemons

start_munge() {
    if pid_alive "$MUNGE_DIR/munged.pid" munged; then return 0; fi
    mkdir -p "$MUNGE_DIR" "$MUNGE_SOCK_DIR"
    if [[ ! -s $MUNGE_DIR/munge.key ]]; then
        # A fresh random key: this cluster never talks to another host.
        (umask 077; head -c 1024 /dev/urandom >"$MUNGE_DIR/munge.key")
    fi
    chown -R munge:munge "$MUNGE_DIR" "$MUNGE_SOCK_DIR"
    chmod 0700 "$MUNGE_DIR"
    chmod 0600 "$MUNGE_DIR/munge.key"
    chmod 0755 "$MUNGE_SOCK_DIR"
    rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
    log "starting munged"
    # --force: the cluster directory lives below /tmp, whose permissions munged would
    # otherwise reject as insecure.
    runuser -u munge -- munged --force \
        --socket="$MUNGE_SOCK" --key-file="$MUNGE_DIR/munge.key" \
        --pid-file="$MUNGE_DIR/munged.pid" --seed-file="$MUNGE_DIR/munged.seed" \
        --log-file="$MUNGE_DIR/munged.log" ||
        die "munged did not start: $(tail -n 5 "$MUNGE_DIR/munged.log" 2>/dev/null)"
    wait_for "$TIMEOUT_S" "munge socket" munge --socket="$MUNGE_SOCK" -n ||
        die "munge does not answer (see $MUNGE_DIR/munged.log)"
}

db() { mariadb --no-defaults --socket="$DB_SOCK" -u root "$@"; }

start_mariadb() {
    if pid_alive "$DB_DIR/run/mysqld.pid" mariadbd; then return 0; fi
    mkdir -p "$DB_DIR/data" "$DB_DIR/run"
    chown -R mysql:mysql "$DB_DIR"
    if [[ ! -d $DB_DIR/data/mysql ]]; then
        log "initialising MariaDB in $DB_DIR/data"
        mariadb-install-db --no-defaults --user=mysql --datadir="$DB_DIR/data" \
            --auth-root-authentication-method=socket --skip-test-db \
            >"$LOG/mariadb-install.log" 2>&1 ||
            die "mariadb-install-db failed (see $LOG/mariadb-install.log)"
    fi
    port_in_use "$DB_PORT" && die "port $DB_PORT is taken by another program (set VIDLABEL_SLURM_DB_PORT)"
    log "starting MariaDB on 127.0.0.1:$DB_PORT"
    # --no-defaults: ignore /etc/mysql (the system database, if any, is left alone).
    setsid mariadbd --no-defaults --user=mysql --datadir="$DB_DIR/data" \
        --socket="$DB_SOCK" --pid-file="$DB_DIR/run/mysqld.pid" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
        --log-error="$LOG/mariadb.log" --innodb-buffer-pool-size=64M \
        --innodb-log-file-size=16M </dev/null >/dev/null 2>&1 &
    wait_for "$TIMEOUT_S" "MariaDB" db -e 'SELECT 1' ||
        die "MariaDB does not answer (see $LOG/mariadb.log)"
    local pass
    pass=$(<"$DB_PASS_FILE")
    # slurmdbd connects over TCP from 127.0.0.1 (name resolution is off, hence the IP).
    db -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
           ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
           GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
           CREATE DATABASE IF NOT EXISTS slurm_acct_db;" ||
        die "could not create the slurm database user"
}

start_slurmdbd() {
    if pid_alive "$RUN/slurmdbd.pid" slurmdbd; then return 0; fi
    port_in_use "$DBD_PORT" && die "port $DBD_PORT is taken by another program"
    log "starting slurmdbd"
    slurmdbd || die "slurmdbd did not start (see $LOG/slurmdbd.log)"
    # sacctmgr talks to slurmdbd directly: it answering means accounting is up.
    wait_for "$TIMEOUT_S" "slurmdbd" sacctmgr -n list cluster ||
        die "slurmdbd does not answer (see $LOG/slurmdbd.log)"
}

# The cluster, the account and the users must exist before slurmctld registers
# (AccountingStorageEnforce=associations refuses jobs of unknown users).
add_associations() {
    local u
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
    if ! sacctmgr -n -P list account format=account | grep -qx "$ACCOUNT"; then
        sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" \
            description="vidlabel test account" organization=vidlabel >/dev/null
    fi
    for u in $USERS; do
        id "$u" >/dev/null 2>&1 || continue
        if ! sacctmgr -n -P list assoc cluster="$CLUSTER" account="$ACCOUNT" user="$u" \
            format=user | grep -qx "$u"; then
            sacctmgr -i add user "$u" account="$ACCOUNT" cluster="$CLUSTER" \
                defaultaccount="$ACCOUNT" >/dev/null
        fi
    done
}

start_slurmctld() {
    if pid_alive "$RUN/slurmctld.pid" slurmctld; then return 0; fi
    port_in_use "$CTLD_PORT" && die "port $CTLD_PORT is taken by another program"
    log "starting slurmctld"
    slurmctld || die "slurmctld did not start (see $LOG/slurmctld.log)"
    wait_for "$TIMEOUT_S" "slurmctld" scontrol ping ||
        die "slurmctld does not answer (see $LOG/slurmctld.log)"
}

start_slurmd() {
    if pid_alive "$RUN/slurmd.pid" slurmd; then return 0; fi
    port_in_use "$SLURMD_PORT" && die "port $SLURMD_PORT is taken by another program"
    log "starting slurmd"
    slurmd -N "$NODE" || die "slurmd did not start (see $LOG/slurmd.log)"
}

node_ready() {
    local state
    state=$(sinfo -h -n "$NODE" -o '%T' 2>/dev/null) || return 1
    # idle, or busy with jobs (start on a running cluster): both are usable.
    [[ $state == idle || $state == mixed || $state == allocated ]] || return 1
    sacct -n -X -S now-1minutes >/dev/null 2>&1
}

cmd_start() {
    local t0=$EPOCHREALTIME
    check_platform
    write_config
    start_munge
    start_mariadb
    start_slurmdbd
    add_associations
    start_slurmctld
    start_slurmd
    if ! wait_for "$TIMEOUT_S" "node $NODE idle and sacct answering" node_ready; then
        sinfo -N -l >&2 || true
        scontrol show node "$NODE" 2>&1 | grep -E 'State|Reason' >&2 || true
        die "cluster not ready (logs in $LOG)"
    fi
    local t1=$EPOCHREALTIME
    printf '[slurm-cluster] ready in %.1f s: partition %s, account %s, %s GPUs; export SLURM_CONF=%s\n' \
        "$(awk -v a="$t0" -v b="$t1" 'BEGIN { print b - a }')" \
        "$PARTITION" "$ACCOUNT" "$GPUS" "$SLURM_CONF"
}

cmd_stop() {
    [[ $(id -u) -eq 0 ]] || die "must run as root"
    if pid_alive "$RUN/slurmctld.pid" slurmctld && scontrol ping >/dev/null 2>&1; then
        # Cancel every job first so that no job step outlives its slurmd.
        if [[ -n $(squeue -h -o %i 2>/dev/null) ]]; then
            log "cancelling jobs: $(squeue -h -o %i | tr '\n' ' ')"
            scancel --full --quiet $(squeue -h -o %i) 2>/dev/null || true
            wait_for 40 "jobs to end" bash -c '[[ -z $(squeue -h -t R,CG,PD -o %i) ]]' || true
        fi
    fi
    stop_pid "$RUN/slurmd.pid" slurmd
    stop_pid "$RUN/slurmctld.pid" slurmctld
    stop_pid "$RUN/slurmdbd.pid" slurmdbd
    stop_pid "$DB_DIR/run/mysqld.pid" mariadbd
    stop_pid "$MUNGE_DIR/munged.pid" munged
    log "stopped"
}

cmd_status() {
    local ok=0 entry pidfile name
    for entry in "$MUNGE_DIR/munged.pid:munged" "$DB_DIR/run/mysqld.pid:mariadbd" \
        "$RUN/slurmdbd.pid:slurmdbd" "$RUN/slurmctld.pid:slurmctld" "$RUN/slurmd.pid:slurmd"; do
        pidfile=${entry%:*}
        name=${entry##*:}
        if pid_alive "$pidfile" "$name"; then
            printf '%-10s running (pid %s)\n' "$name" "$(<"$pidfile")"
        else
            printf '%-10s stopped\n' "$name"
            ok=1
        fi
    done
    if ((ok == 0)); then
        sinfo -N -o '%N %P %T %c %m %G' || ok=1
        node_ready || ok=1
    fi
    echo "export SLURM_CONF=$SLURM_CONF"
    return $ok
}

case ${1:-} in
start) cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
env) echo "export SLURM_CONF=$SLURM_CONF" ;;
purge)
    cmd_stop
    unlink_system_config
    log "removing $DIR"
    rm -rf -- "$DIR"
    ;;
*)
    echo "usage: $0 start|stop|status|env|purge" >&2
    exit 2
    ;;
esac
