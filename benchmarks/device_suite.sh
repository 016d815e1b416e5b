#!/usr/bin/env bash
# GPU checks and benchmarks in stages, for one call on a GPU machine:
#
#   bash benchmarks/device_suite.sh tests sgmv-quick decode     # GPU tests, then quick figures
#   bash benchmarks/device_suite.sh prefill                      # prefill step + per-op profile
#   bash benchmarks/device_suite.sh kernel-tests                 # tests/kernels compiled (slow)
#   bash benchmarks/device_suite.sh adapter-read                 # disk -> pinned host read phases
#   bash benchmarks/device_suite.sh churn16                      # the churn matrix, a call each:
#   bash benchmarks/device_suite.sh churn-large                  #   each stage takes minutes
#   bash benchmarks/device_suite.sh churn-256                    #   (run each alone)
#   bash benchmarks/device_suite.sh churn-chat                   #   prompts of 256-1024 tokens
#   bash benchmarks/device_suite.sh churn-chat-128               #   (also churn-chat-busy,
#                                                                #   churn128-large: one a call)
#   bash benchmarks/device_suite.sh churn128 seeds
#   bash benchmarks/device_suite.sh serve                        # the app through HTTP against
#   bash benchmarks/device_suite.sh serve-poisson                #   the engine in-process and the
#   bash benchmarks/device_suite.sh serve-seeds                  #   roofline (Ray Serve; one a call)
#   bash benchmarks/device_suite.sh serve-process                # saturated, then seeds: the
#   bash benchmarks/device_suite.sh serve-seeds-process          #   engine loop on a thread, then
#                                                                #   in a process (one a call)
#   bash benchmarks/device_suite.sh serve-split                  # the served path's CPU a token:
#                                                                #   saturated (HTTP), then every
#                                                                #   replica's user code on a
#                                                                #   thread of its own, then
#                                                                #   16-token outputs (per request
#                                                                #   against per token); ~6 min
#   bash benchmarks/device_suite.sh serve-floor                  # Serve's own request path with
#                                                                #   null handlers: host CPU a
#                                                                #   request (no GPU; ~2 min)
#   bash benchmarks/device_suite.sh serve-floor-512              #   512 at once (~4 min)
#   bash benchmarks/device_suite.sh serve-2x                     #   saturated on 2 GPUs
#   bash benchmarks/device_suite.sh serve-scale                  # saturated on 1, 2 and 4 GPUs
#                                                                #   of one machine, 512 requests
#                                                                #   a replica (4 GPUs; ~8 min)
#   bash benchmarks/device_suite.sh serve-scale-timed            # the same on this host's CPUs
#                                                                #   with timed steps (~5 min)
#   bash benchmarks/device_suite.sh serve-ramp                   # its ramp by hop and profile
#   bash benchmarks/device_suite.sh router                       # needs 2+ GPUs and Ray Serve
#   bash benchmarks/device_suite.sh router-uniform               #   (skewed, then uniform)
#   bash benchmarks/device_suite.sh router-placement             # the routing cells of
#   bash benchmarks/device_suite.sh router-placement-4           #   sim/cells.py, one a call:
#   bash benchmarks/device_suite.sh router-easy                  #   2 GPUs, or 4 with -4; pow2,
#   bash benchmarks/device_suite.sh router-easy-4                #   affinity, affinity+hints in
#   bash benchmarks/device_suite.sh router-hot                   #   that order (ROUTERS=... to
#   bash benchmarks/device_suite.sh router-hot-4                 #   choose), each row saved as
#                                                                #   it ends, with the simulator's
#                                                                #   prediction beside it
#
# Stage lengths seen on an H100: decode 72 s, sgmv-quick 35 s, churn16 349 s (48 requests a
# cell), churn-large ~520 s (80 a cell; 125 s of it builds the first engine, 126 s the
# all-resident one: run it alone in a call), churn128 132 s (40 a cell), churn-chat 447 s,
# churn-chat-128 468 s, churn-chat-busy 316 s, churn128-large 229-282 s (the first engine's build
# takes 110 s on a fresh machine), churn-large 343 s on a warm one. `tests` takes 200-450 s,
# most of it compiling kernels (the float32 engine test alone 75 s); it once sat in an SGMV
# launch of its warm-up for over 140 s (float32 tiles are capped since).
#
# Where Ray is not installed, put it on the path first (e.g. a prepared site-packages bundle);
# every stage but `router` needs only torch, triton, transformers, peft and safetensors.
#
# `COMMIT=<sha>` names the tree in every result file (the GPU machine has no git history).
#
# Every stage has its own time limit and writes its log and result files under $OUT (default
# benchmarks/results), so one stage failing or running long leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"

stage() {  # stage NAME LIMIT_S COMMAND...
    local name="$1" limit="$2"
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc in $((SECONDS - start))s"
    tail -n 15 "$OUT/$name.log"
}

churn() {  # churn NAME LIMIT_S ARGS...
    local name="$1" limit="$2"
    shift 2
    stage "$name" "$limit" python -m benchmarks.bench_churn --out "$OUT" "$@"
}

for s in "$@"; do
    case "$s" in
        tests)  # every GPU test, recorded in $OUT/gpu_tests.md (COMMIT names the tree)
            stage tests 540 python -m tools.gpu_tests --commit "${COMMIT:-unknown}" --out "$OUT" ;;
        kernel-tests) stage kernel-tests 300 python -m pytest -q -x tests/kernels ;;
        decode) stage decode 180 python -m benchmarks.bench_decode_step --out "$OUT" ;;
        prefill) stage prefill 240 python -m benchmarks.bench_prefill_step --profile --out "$OUT" ;;
        adapter-read)  # ranks 16 and 128: about 20 s and 60 s on an H100 host
            stage adapter-read-r16 120 python -m benchmarks.bench_adapter_read --rank 16 --out "$OUT"
            stage adapter-read-r128 200 python -m benchmarks.bench_adapter_read --rank 128 \
                --out "$OUT" ;;
        sgmv-quick) stage sgmv-quick 150 python -m benchmarks.bench_sgmv --quick --out "$OUT" ;;
        sgmv) stage sgmv 300 python -m benchmarks.bench_sgmv --out "$OUT" ;;
        churn16)
            churn churn16 420 --num-adapters 32 --rank 16 --slots 8 --rate 4 --num-requests 48 \
                --popularity distinct,uniform,skewed --resident ;;
        churn-large)  # 0.67 GB adapters: copies of ~13 ms, where loading dominates
            churn churn-large 570 --num-adapters 32 --rank 128 --slots 8 --rate 6 \
                --num-requests 80 --input-len 64:256 --output-len 16:64 --kv-blocks 2048 \
                --popularity distinct,uniform --resident ;;
        churn-256)  # 1.3 GB adapters (copies of ~25 ms) and short prompts: loading dominates
            churn churn-256 570 --num-adapters 16 --rank 256 --slots 4 --rate 4 \
                --num-requests 48 --input-len 32:96 --output-len 8:32 --kv-blocks 1024 \
                --popularity distinct,skewed --resident ;;
        churn-chat)  # rank 256 (copies of ~25 ms) under chat-like prompts, whose prefill is
            # about as long as the copy: per-layer pipelining can hide a copy under its prefill
            churn churn-chat 570 --num-adapters 16 --rank 256 --slots 8 --rate 4 \
                --num-requests 48 --input-len 256:1024 --output-len 16:64 --kv-blocks 2048 \
                --popularity distinct,uniform --resident --name churn_16x_r256_chat ;;
        churn-chat-busy)  # the rank-256 chat-like cell at twice the rate: blocking loads queue
            churn churn-chat-busy 400 --num-adapters 16 --rank 256 --slots 8 --rate 8 \
                --num-requests 64 --input-len 256:1024 --output-len 16:64 --kv-blocks 2048 \
                --popularity distinct --modes blocking,prefetch --resident \
                --name churn_16x_r256_chat_rate8 ;;
        churn-chat-128)  # the same prompts, 32 rank-128 adapters over 8 slots
            churn churn-chat-128 570 --num-adapters 32 --rank 128 --slots 8 --rate 4 \
                --num-requests 48 --input-len 256:1024 --output-len 16:64 --kv-blocks 2048 \
                --popularity distinct,uniform --resident --name churn_32x_r128_chat ;;
        churn128-large)  # 128 rank-128 adapters, host cache of 32 (21 GB pinned): reads of 671 MB
            # join the churn; no all-resident run (128 slots of 671 MB do not fit the GPU)
            churn churn128-large 540 --num-adapters 128 --rank 128 --slots 8 --host-cache 32 \
                --rate 4 --num-requests 48 --input-len 256:1024 --output-len 16:64 \
                --kv-blocks 2048 --popularity uniform,skewed --name churn_128x_r128 ;;
        churn128)  # a host cache of 32: disk reads join the churn
            churn churn128 300 --num-adapters 128 --rank 16 --slots 8 --host-cache 32 --rate 4 \
                --num-requests 80 --popularity uniform,skewed ;;
        seeds)
            churn seeds 200 --num-adapters 1 --rank 16 --slots 1 --rate 8 --num-requests 480 \
                --input-len 200:1000 --output-len 100:400 --popularity distinct --modes prefetch --kv-blocks 0 \
                --max-num-seqs 128 --name seeds_shape \
                --published "SGLang:ttft_p50_ms=62.65,itl_p50_ms=22.68" ;;
        serve | serve-poisson | serve-seeds)  # workloads saturated, poisson, seeds
            workload=saturated
            [ "$s" != serve ] && workload="${s#serve-}"
            stage "$s" 570 python -m benchmarks.bench_serve --workload "$workload" --out "$OUT" ;;
        serve-scale)  # scale-out: one replica against in-process, then 2 and 4 through HTTP
            # with the same load a replica, each on GPUs of its own (needs 4)
            stage serve-scale-1x 250 python -m benchmarks.bench_serve --workload saturated \
                --name saturated_scale_1x --out "$OUT"
            for n in 2 4; do
                stage "serve-scale-${n}x" 200 python -m benchmarks.bench_serve --workload saturated \
                    --replicas "$n" --num-requests $((512 * n)) --http-only \
                    --name "saturated_scale_${n}x" --out "$OUT"
            done ;;
        serve-scale-timed)  # the served path's scale-out on this host's CPUs: timed steps (the
            # H200's calibrated step times, the launch share run as Python), engine loops in
            # processes and 2 ingress replicas an engine replica as on GPUs, 1, 2 and 4
            # replicas, 512 requests a replica; no GPU used
            for n in 1 2 4; do
                only=--http-only
                [ "$n" = 1 ] && only=
                stage "serve-scale-timed-${n}x" 200 python -m benchmarks.bench_serve \
                    --workload saturated --timed --host-share 0.29 --set engine_process=true \
                    --set num_ingress_replicas=$((2 * n)) \
                    --replicas "$n" --num-requests $((512 * n)) $only \
                    --name "saturated_scale_timed_${n}x" --out "$OUT"
            done ;;
        serve-ramp)  # where a burst's ramp waits, by hop and by profile: serve-scale-timed's
            # runs with the hop log on, py-spy over each first stream's first 3 s and Serve's
            # logs kept, then the proxy before a null ingress; one tarball, ramp.tgz (~7 min).
            # py-spy must be on the PATH: `pip download py-spy --no-deps -d .gpu` beforehand,
            # then on the device `pip install -q --target /tmp/pyspy .gpu/py_spy-*.whl` and
            # `export PATH=/tmp/pyspy/bin:$PATH`. RAMP_REPLICAS="1 2 4" chooses the runs.
            ramp="$OUT/ramp"
            mkdir -p "$ramp"
            for n in ${RAMP_REPLICAS:-1 2 4}; do
                rm -rf "/tmp/hops_${n}x"
                LORAFLEET_HOP_LOG="/tmp/hops_${n}x" RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE=1 \
                    OUT="$ramp" stage "serve-ramp-${n}x" 200 python -m benchmarks.bench_serve \
                    --workload saturated --timed --host-share 0.29 --set engine_process=true \
                    --set num_ingress_replicas=$((2 * n)) --replicas "$n" \
                    --num-requests $((512 * n)) --http-only --profile "$ramp/prof_${n}x" \
                    --profile-s 3 --name "scale_timed_${n}x_ramp" --out "$ramp"
                cp -r /tmp/ray/session_latest/logs/serve "$ramp/serve_logs_${n}x"
                python -m benchmarks.serve_hops "/tmp/hops_${n}x" "$ramp/serve_logs_${n}x" \
                    --out "$ramp/serve_hops_${n}x.md" >/dev/null
            done
            for n in 2 8; do  # the proxy alone, before a null ingress: its forward rate
                OUT="$ramp" stage "proxy-intake-${n}" 150 python -m benchmarks.bench_proxy_intake \
                    --requests 2048 --ingress-replicas "$n" --out "$ramp"
            done
            tar czf "$OUT/ramp.tgz" -C "$OUT" ramp && rm -rf "$ramp" ;;
        serve-process | serve-seeds-process)  # the engine loop on a thread, then in a process
            # of its own (HTTP only: the first run's in-process figure is the baseline; then
            # python -m benchmarks.serve_compare --pair THREAD.json:PROCESS.json)
            workload=saturated
            [ "$s" = serve-seeds-process ] && workload=seeds
            stage "$s-thread" 300 python -m benchmarks.bench_serve --workload "$workload" \
                --set engine_process=false --name "${workload}_thread" --out "$OUT"
            stage "$s-process" 250 python -m benchmarks.bench_serve --workload "$workload" \
                --set engine_process=true --http-only --name "${workload}_process" --out "$OUT" ;;
        serve-split)  # where the served path's CPU goes, one machine: HTTP only, each run
            # against the first (user code on each replica's main loop by default)
            stage serve-split-default 170 python -m benchmarks.bench_serve --workload saturated \
                --http-only --name saturated_split_default --out "$OUT"
            RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=1 stage serve-split-user-thread 170 \
                python -m benchmarks.bench_serve --workload saturated --http-only \
                --name saturated_split_user_thread --out "$OUT"
            stage serve-split-out16 170 python -m benchmarks.bench_serve --workload saturated \
                --http-only --output-len 16 --num-requests 1024 --name saturated_split_out16 \
                --out "$OUT" ;;
        serve-floor)  # the floor under the served path's CPU a request, 128 at once (~2 min)
            stage serve-floor 150 python -m benchmarks.bench_serve_floor --out "$OUT" ;;
        serve-floor-512)  # the same, 512 at once: about 65 s a route on an H200 host
            stage serve-floor-512 280 python -m benchmarks.bench_serve_floor --requests 4096 \
                --concurrency 512 --name serve_floor_512 --out "$OUT" ;;
        serve-2x)  # needs 2 GPUs
            stage serve-2x 570 python -m benchmarks.bench_serve --workload saturated --replicas 2 \
                --out "$OUT" ;;
        router | router-uniform)  # one popularity a call: three routers took 346 s on 2 H200s
            pop=skewed
            [ "$s" = router-uniform ] && pop=uniform
            stage "$s" 560 python -m benchmarks.bench_router_serve --replicas 2 \
                --num-adapters 64 --rank 16 --slots 8 --rate 6 --num-requests 300 \
                --popularity "$pop" --name "2x_64a_r16_s8_$pop" --out "$OUT" ;;
        router-placement | router-placement-4 | router-easy | router-easy-4 | router-hot | \
            router-hot-4)
            # router-placement -> cell placement-2x, router-placement-4 -> placement-4x
            cell="${s#router-}"
            case "$cell" in *-4) cell="${cell%-4}-4x" ;; *) cell="$cell-2x" ;; esac
            stage "$s" 560 python -m benchmarks.bench_router_serve --cell "$cell" \
                --routers "${ROUTERS:-pow2,affinity,affinity+hints}" --out "$OUT" ;;
        *) echo "unknown stage $s"; exit 2 ;;
    esac
done
