#!/usr/bin/env bash
# One unattended GPU session: the mixed set made and prepared, the breaker's broken run, then the steady-state
# run of the same variant on the same journal (the breaker's fixed run), each step timed and logged.
#
# On the GPU machine, from a checkout's root (a copy of it: the device's re-sync of the working tree must not
# touch the script bash is reading), once the client wheels are installed (ffmpeg in /tmp/bin, /tmp/vsite2;
# they need nothing of the kit) and with PATH=/tmp/bin:$PATH PYTHONPATH=/tmp/vsite2:/tmp/vsite:/tmp/site:
#     mkdir -p /tmp/session && setsid nohup bash benchmarks/gpu_session.sh > /tmp/session/driver.log 2>&1 < /dev/null &
# The media step needs no vLLM: the kit (../shared/gpu-kit) may be staged and installed while it runs; the
# step after it waits for the kit (KIT_READY, a file the call that ran the kit's install.sh touches).
# It never waits for an answer; poll /tmp/session/progress.txt (one line per step start and end) and DONE (the
# exit status, written last). A failed step stops the session: the job's own server is stopped by the job,
# and any server a step left running (its pid read from the step's log) is stopped by this script on exit.
#
# Steps (each output in SESSION_DIR/NN-name.log, the results' JSON copied to SESSION_DIR at the end):
#   00-check    the client's imports, ffmpeg, nvidia-smi
#   01-media    gpu_classify.py media: camera-like videos, the format zoo, photo posts and carousels
#   02-kit      waits (up to KIT_WAIT_S) for KIT_READY; then vllm on PATH and the tokenizer
#   03-prepare  gpu_classify.py prepare --modes raw (with the model's tokenizer), per run of RUNS
#   04-breaker  gpu_breaker.py --phase broken --broken-runs 1 --shared-run-dir: a server whose video decoder
#               cannot load; the job must stop within 60 s with the server's message, journaling nothing
#               terminal, into the run folder of VARIANT (a failed check is recorded and the session goes on);
#               its posts interleaved (--interleave: photos, slideshows and carousels first, a video after each)
#   05-steady   gpu_steady.py VARIANT on the same journal: the fixed run, every post labelled; per post type
#               steady windows; its request phase is cut (SIGINT, --max-request-phase-s) so that the job
#               ends by DEADLINE_S after this script's start
#   RUNS        several models one after another (issue 35's families): each run "MODEL:AUDIO:NAME" gets its
#               own prepare (03-prepare-NAME: the model's family plans its own manifest) and steady step
#               (05-steady-NAME, variant VARIANT@NAME), the time left shared among the runs still to go;
#               "MODEL:AUDIO:NAME:WORDS" runs variant words WORDS in place of VARIANT's (before its @), e.g.
#               RUNS="Qwen/Qwen2.5-VL-7B-Instruct:transcript:fixed: Qwen/Qwen2.5-VL-7B-Instruct:transcript:adapt:adapt";
#               a fifth field pins that run's steady step to those cores (CPUS otherwise), e.g. ":transcoded:0-7"
#
# Settings (environment; defaults for one H200 with 16 cores and the kit's Qwen2.5-VL-7B):
#   SESSION_DIR=/tmp/session WORKDIR=/tmp/steady CPUS=0-<nproc-1> JOBS=<nproc> VARIANT=default-@mixed SEED=5
#   SOURCES=40 POSTS=300 PHOTO_POSTS=80 CAROUSELS=80 AUDIO_POSTS=0 MIN_REQUESTS=200
#   RUNS="Qwen/Qwen2.5-VL-7B-Instruct:transcript:" (one run of the default model); e.g.
#        RUNS="Qwen/Qwen3-VL-8B-Instruct:transcript:q3vl Qwen/Qwen3-Omni-30B-A3B-Instruct:native:heard"
#        (each run's tokenizer: /tmp/models/<the model's last name part>; the breaker step is for the first)
#   VIDLABEL_SPEECH_POOL=DIR recordings the media step speaks with where espeak-ng is missing (speech_pool.py)
#                  (~480 requests: ~6 min of request phase at the ~1.3 req/s measured on camera-like media)
#   DEADLINE_S=1260  seconds after this script's start by which the steady job should have ended (started
#                  before the kit is staged: ~21 min; started after it: 1140)
#   KIT_READY=/tmp/stage/KIT_INSTALLED KIT_WAIT_S=900
#   SERVER_START_S=180 TAIL_S=120  what the steady step needs besides its request phase (server start;
#                  drain, server stop, decode replay and report)
#   SKIP_BREAKER=1 no broken run: the steady run alone (its server started once; ~3 min of device time less)
#   STANDIN=1      the test stand-in instead of vLLM (a rehearsal without a GPU; no tokenizer then)
#   ESTIMATE=N     06-estimate after the runs: gpu_classify.py estimate, the pilot of N requests on its own
#                  server and its projected job time against the first run's measured job (issue 36's ETA
#                  check: that job must answer its whole shard before the deadline); the runs' deadline is
#                  ESTIMATE_RESERVE_S=360 earlier to leave it room
set -uo pipefail

S=${SESSION_DIR:-/tmp/session}
W=${WORKDIR:-/tmp/steady}
NCPU=$(nproc)
CPUS=${CPUS:-0-$(( NCPU - 1 ))}  # every core (16 on the H200 machine)
JOBS=${JOBS:-$NCPU}
VARIANT=${VARIANT:-default-@mixed}
SEED=${SEED:-5}
SOURCES=${SOURCES:-40}
POSTS=${POSTS:-300}
PHOTO_POSTS=${PHOTO_POSTS:-80}
CAROUSELS=${CAROUSELS:-80}
AUDIO_POSTS=${AUDIO_POSTS:-0}
RUNS=${RUNS:-Qwen/Qwen2.5-VL-7B-Instruct:transcript:}
DEADLINE_S=${DEADLINE_S:-1260}
KIT_READY=${KIT_READY:-/tmp/stage/KIT_INSTALLED}
KIT_WAIT_S=${KIT_WAIT_S:-900}
SERVER_START_S=${SERVER_START_S:-180}
TAIL_S=${TAIL_S:-120}
PY=${PYTHON:-python3}
REPO=$(cd "$(dirname "$0")/.." && pwd)
T0=$(date +%s)
export PYTHONUNBUFFERED=1

mkdir -p "$S"
rm -f "$S/DONE"
stamp() { date -u +%H:%M:%S; }
note() { echo "$(stamp) +$(( $(date +%s) - T0 ))s $*" | tee -a "$S/progress.txt"; }

# Servers the steps' jobs started (vidlabel logs "server N started (pid P, ..."): each in a process group of its
# own; stopped here if a step left one running (a job killed before its own cleanup).
stop_servers() {
    local pid
    for pid in $(grep -ho "server [0-9]* started (pid [0-9]*" "$S"/[0-9]*.log 2>/dev/null | awk '{print $5}' | sort -u); do
        if kill -0 "$pid" 2>/dev/null; then
            note "stopping server process group $pid left running"
            kill -TERM -- "-$pid" 2>/dev/null
            for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
            kill -KILL -- "-$pid" 2>/dev/null
        fi
    done
}

finish() {
    local rc=$?
    if [ -n "${STEP_PID:-}" ] && kill -0 "$STEP_PID" 2>/dev/null; then  # the driver itself was stopped mid-step
        note "stopping the running step (pid $STEP_PID)"
        kill -INT "$STEP_PID" 2>/dev/null
        for _ in $(seq 90); do kill -0 "$STEP_PID" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$STEP_PID" 2>/dev/null  # timeout leads its own process group: it and the step
    fi
    stop_servers
    for f in gpu_classify.json gpu_breaker.json media.json; do
        [ -f "$W/$f" ] && cp "$W/$f" "$S/$f"
    done
    for d in "$W"/data-raw*/; do  # one data folder per model run (its family's plan)
        for f in prepare.json manifest/post_plans.csv manifest/plan.csv manifest/media_limits.json \
                 inventory.parquet manifest/excluded.parquet manifest/shard-0.parquet; do
            [ -f "$d/$f" ] && cp "$d/$f" "$S/$(basename "$d")-$(basename "$f")"
        done
    done
    for d in "$W"/runs/*/; do  # the run folders' server logs are long: their tails
        [ -f "$d/server.log" ] && tail -c 200000 "$d/server.log" > "$S/server-$(basename "$d").log.tail"
        # The labels, journal and 1 s samples of each run: the runs compared side by side afterwards (e.g. a
        # model heard and read) and read again, on any machine
        for f in labels.parquet journal.jsonl samples.json; do
            [ -f "$d/$f" ] && cp "$d/$f" "$S/$(basename "$d")-$f"
        done
    done
    note "driver exit status $rc (${FAILED:-no step failed}${RESULT_FAILED:+; checks failed: $RESULT_FAILED})"
    echo "$rc" > "$S/DONE"
}
trap finish EXIT
trap 'note "driver interrupted"; exit 130' INT TERM

# step NAME LIMIT_S COMMAND...: run, log, time; a failure ends the session, unless SOFT (a command) says the
# step ran to its end and recorded a result that merely failed its check (the session goes on then).
step() {
    local name=$1 limit=$2; shift 2
    local log="$S/$name.log" t rc
    note "start $name (limit ${limit}s): $*"
    t=$(date +%s)
    # timeout runs the command in a process group of its own and passes it SIGINT at the limit (vidlabel's job
    # then stops sending, journals what finished and stops its server); its pid in step.pid: `kill -INT` it to
    # end the step by hand.
    timeout --signal=INT --kill-after=90 "$limit" "$@" > "$log" 2>&1 &
    STEP_PID=$!
    echo "$STEP_PID" > "$S/step.pid"
    wait "$STEP_PID"
    rc=$?
    STEP_PID=
    note "end $name: exit $rc after $(( $(date +%s) - t ))s"
    if [ "$rc" -ne 0 ] && [ -n "${SOFT:-}" ] && bash -c "$SOFT"; then
        note "$name: its check failed but its result is recorded: going on"
        RESULT_FAILED="${RESULT_FAILED:-}$name "
        return 0
    fi
    if [ "$rc" -ne 0 ]; then
        FAILED="$name failed (exit $rc)"
        tail -n 30 "$log" | cut -c1-400 | sed 's/^/    /' | tee -a "$S/progress.txt"
        exit "$rc"
    fi
}

cd "$REPO" || exit 1
note "session: repo $REPO, workdir $W, cpus $CPUS, jobs $JOBS, variant $VARIANT, sources $SOURCES, posts $POSTS," \
     "photo posts $PHOTO_POSTS, carousels $CAROUSELS, deadline ${DEADLINE_S}s ${STANDIN:+(stand-in)}"

cat > "$S/check.py" <<'EOF'
import sys
import av, ffmpeg, pillow_heif, PIL, jsonschema, cv2, pyarrow, yaml, aiohttp, httpx, yarl, numpy
print("python", sys.version.split()[0], "av", av.__version__, "pillow", PIL.__version__, "opencv", cv2.__version__,
      "numpy", numpy.__version__, "pyarrow", pyarrow.__version__)
for m in (av, ffmpeg, pillow_heif, jsonschema, aiohttp, httpx, yarl):
    print(" ", m.__name__, m.__file__)
EOF
GPU_CHECK="nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv"
[ -n "${STANDIN:-}" ] && GPU_CHECK=true
step 00-check 120 bash -c "$PY $S/check.py && ffmpeg -hide_banner -version | head -1 && $GPU_CHECK && nproc"
cut -c1-300 "$S/00-check.log" | sed 's/^/    /' | tee -a "$S/progress.txt"

step 01-media 900 "$PY" benchmarks/gpu_classify.py media --workdir "$W" --kind camera --sources "$SOURCES" \
    --posts "$POSTS" --formats --photo-posts "$PHOTO_POSTS" --carousels "$CAROUSELS" --audio-posts "$AUDIO_POSTS" \
    --jobs "$JOBS" --seed "$SEED"
grep "^media" "$S/01-media.log" | cut -c1-300 | sed 's/^/    /' | tee -a "$S/progress.txt"

# The runs: MODEL:AUDIO:NAME each (NAME empty: the one default run, its steps and variant as before).
read -r -a RUN_LIST <<< "$RUNS"
run_args() {  # the model arguments of a run: its model, audio mode and tokenizer (or the stand-in)
    local model=$1 audio=$2
    if [ -n "${STANDIN:-}" ]; then echo "--model $model --audio $audio --standin"
    else echo "--model $model --audio $audio --tokenizer /tmp/models/$(basename "$model")"; fi
}
TOKENIZER=/tmp/models/$(basename "${RUN_LIST[0]%%:*}")  # the first run's (the kit's folders by the models' names)

if [ -z "${STANDIN:-}" ]; then  # the stand-in's `vllm` is put on PATH by each step
    step 02-kit $(( KIT_WAIT_S + 60 )) bash -c "for i in \$(seq $KIT_WAIT_S); do [ -f '$KIT_READY' ] && break; sleep 1; done
        [ -f '$KIT_READY' ] || { echo 'the kit is not installed ($KIT_READY missing after ${KIT_WAIT_S}s)'; exit 1; }
        command -v vllm && ls -d '$TOKENIZER'"  # a folder: tokenizer.json, or vocab.json + merges.txt (Omni)
fi

RESERVE=0
[ -n "${ESTIMATE:-}" ] && RESERVE=${ESTIMATE_RESERVE_S:-360}
FIRST_RUN_VARIANT= FIRST_MODEL_ARGS=()
LEFT=${#RUN_LIST[@]}
for RUN in "${RUN_LIST[@]}"; do
    IFS=: read -r MODEL AUDIO NAME WORDS RUN_CPUS <<< "$RUN"
    read -r -a MODEL_ARGS <<< "$(run_args "$MODEL" "${AUDIO:-transcript}")"
    SUFFIX=${NAME:+-$NAME}
    RUN_VARIANT=$VARIANT
    if [ -n "$WORDS" ]; then
        case $VARIANT in *@*) RUN_VARIANT="$WORDS-@${VARIANT#*@}" ;; *) RUN_VARIANT=$WORDS ;; esac
    fi
    RUN_VARIANT=$RUN_VARIANT${NAME:+@$NAME}
    # With several runs a failed one is recorded and the next one goes on.
    [ "${#RUN_LIST[@]}" -gt 1 ] && RUN_SOFT=true || RUN_SOFT=
    SOFT=$RUN_SOFT step 03-prepare$SUFFIX 600 "$PY" benchmarks/gpu_classify.py prepare --workdir "$W" --jobs "$JOBS" \
        --modes raw "${MODEL_ARGS[@]}"
    grep -E "manifest: [0-9]+ posts ->|^raw" "$S/03-prepare$SUFFIX.log" | cut -c1-300 | sed 's/^/    /' | tee -a "$S/progress.txt"

    # The breaker's check failing (a stop later than 60 s, another message) is a result: the steady run still counts.
    if [ -z "${SKIP_BREAKER:-}" ] && [ "$LEFT" -eq "${#RUN_LIST[@]}" ]; then
    rm -f "$W/gpu_breaker.json"
    SOFT="grep -q '\"broken_passed\"' '$W/gpu_breaker.json'" \
    step 04-breaker 900 "$PY" benchmarks/gpu_breaker.py --workdir "$W" --jobs "$JOBS" --cpus "$CPUS" --kind camera \
        --variant "$RUN_VARIANT" --shared-run-dir --phase broken --broken-runs 1 --interleave "${MODEL_ARGS[@]}"
    grep -E "^broken|ready on port|stopping:" "$S/04-breaker.log" | cut -c1-400 | sed 's/^/    /' | tee -a "$S/progress.txt"
    fi

    # The steady job's request phase: its share of what is left until the deadline, less the server's start and
    # the tail of each run still to go.
    PHASE=$(( (T0 + DEADLINE_S - RESERVE - $(date +%s)) / LEFT - SERVER_START_S - TAIL_S ))
    [ "$PHASE" -lt 60 ] && PHASE=60
    note "steady request phase of $RUN_VARIANT at most ${PHASE}s (deadline ${DEADLINE_S}s after the driver's start, $LEFT run(s) to go)"
    SOFT=$RUN_SOFT step 05-steady$SUFFIX $(( PHASE + SERVER_START_S + TAIL_S + 600 )) "$PY" benchmarks/gpu_steady.py \
        --workdir "$W" --cpus "${RUN_CPUS:-$CPUS}" --jobs "$JOBS" --variants "$RUN_VARIANT" --max-request-phase-s "$PHASE" \
        --min-requests "${MIN_REQUESTS:-200}" "${MODEL_ARGS[@]}"
    sed -n '/^| variant | CPUs/,$p' "$S/05-steady$SUFFIX.log" | cut -c1-600 | tee -a "$S/progress.txt"
    [ -z "$FIRST_RUN_VARIANT" ] && FIRST_RUN_VARIANT=$RUN_VARIANT && FIRST_MODEL_ARGS=("${MODEL_ARGS[@]}")
    LEFT=$(( LEFT - 1 ))
done

# The pilot's ETA against the first run's measured job (the same media, variant and model).
if [ -n "${ESTIMATE:-}" ]; then
    step 06-estimate $(( RESERVE + 600 )) "$PY" benchmarks/gpu_classify.py estimate --workdir "$W" --jobs "$JOBS" \
        --variant "$FIRST_RUN_VARIANT" --pilot-size "$ESTIMATE" "${FIRST_MODEL_ARGS[@]}"
    grep -E "^estimate \(" "$S/06-estimate.log" | cut -c1-600 | tee -a "$S/progress.txt"
fi
exit 0
