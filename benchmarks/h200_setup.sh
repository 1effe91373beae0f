# Sourced at the start of a command on the H200 machine: installs the carried wheels
# (dask, distributed, dask-cuda; see ../shared/tools/gpu-wheels.sh) and uses the tree.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl || exit 1
export PYTHONPATH="$PWD:$PWD/.site" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import cupy, dask, distributed, numpy; print('cupy', cupy.__version__, 'dask', dask.__version__, 'distributed', distributed.__version__, 'numpy', numpy.__version__)"
# What the calling scripts share: `results NAME` makes R=/tmp/NAME-COMMIT (COMMIT: the
# script's first argument) with commit.txt in it; `gpu_tests SECONDS` runs tests/gpu into
# $R/gpu-tests.txt and appends its exit status.
COMMIT="${1:-unknown}"
results() { R="/tmp/$1-$COMMIT"; mkdir -p "$R"; echo "commit $COMMIT" > "$R/commit.txt"; }
# `pack`: $R as $OUT/<its name>.tgz, what comes back from the call (again after each part).
pack() { tar -C /tmp -czf "$OUT/${R#/tmp/}.tgz" "${R#/tmp/}"; }
# `part NAME CHOICES`: for scripts in parts, PART (the script's second argument, one of the
# words of CHOICES; else a usage line and exit 2) and `results NAME-PART`.
PART="${2:-}"
part() {
    case " $2 " in
        *" $PART "*) [ -n "$PART" ] && results "$1-$PART" && return ;;
    esac
    echo "usage: bash $0 COMMIT PART, PART one of: $2" >&2
    exit 2
}
# `shapes NAME SECONDS ARGS...` runs bench_shapes' wide shapes on distributed (policy auto,
# a warm-up and 3 samples) with ARGS into $R/shapes-NAME and its log, and appends its exit
# status.
shapes() {
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" python3 -m benchmarks.bench_shapes --backend cupy --schedulers \
        distributed --families wide --policies auto --warmup 1 --samples 3 \
        --out "$R/shapes-$name" "$@" > "$R/shapes-$name.log" 2>&1
    echo "shapes rc $?" >> "$R/shapes-$name.log"
}
gpu_tests() {
    timeout "$1" python3 -m pytest -q -p no:cacheprovider -rs tests/gpu > "$R/gpu-tests.txt" 2>&1
    echo "gpu tests rc $?" >> "$R/gpu-tests.txt"
}
# `launcher_workloads SECONDS OVERHEAD_SECONDS [MODES]`: the workloads (13 since f697d93)
# under MODES (default plain threads, plain sync and the launcher) into $R/workloads and its
# log (with its exit status), then the runtime's cost per no-op task into $R/overhead.txt.
launcher_workloads() {
    timeout "$1" python3 -m benchmarks.bench_workloads --backend cupy \
        --modes "${3:-threads,sync,launcher}" --samples 4 --rounds 2 --warmup 1 --set rechunk.n=4096 \
        --out "$R/workloads" > "$R/workloads.log" 2>&1
    echo "workloads rc $?" >> "$R/workloads.log"
    timeout "$2" python3 -m benchmarks.bench_overhead --backend cupy --tasks 10000 --repeats 3 \
        --policies auto > "$R/overhead.txt" 2>&1
}
# `cluster_part SECONDS WORKLOADS ARGS...`: bench_cluster on LocalCUDACluster, plugin off and
# on, over WORKLOADS (with ARGS) into $R/cluster and its log, then the plugin's hook cost on
# the worker's event loop into $R/hooks.txt; prints both, with their exit statuses.
cluster_part() {
    local seconds=$1 workloads=$2
    shift 2
    timeout "$seconds" python3 -m benchmarks.bench_cluster --backend cupy \
        --workloads "$workloads" --modes off,on --samples 2 --rounds 2 --warmup 1 "$@" \
        --out "$R/cluster" > "$R/cluster.log" 2>&1
    echo "cluster rc $?" >> "$R/cluster.log"
    timeout 70 python3 -m benchmarks.probe_distributed --hook-times --reps 2 \
        > "$R/hooks.txt" 2>&1
    echo "hooks rc $?" >> "$R/hooks.txt"
    grep "^\[\|rc \|geometric" "$R/cluster.log"
    grep -v "^\[" "$R/cluster.log" | tail -20
    tail -25 "$R/hooks.txt"
}
