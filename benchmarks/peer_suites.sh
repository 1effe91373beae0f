#!/usr/bin/env bash
# Run Dask's and distributed's own test modules plain, with dask_gpustreams imported but
# off, and with it on (sim backend); print the tests that pass plain and fail with the plugin.
#
#   benchmarks/peer_suites.sh [MODULE ...]
#
# MODULE is a path as in the test's node id: dask/... (the tests in the installed dask wheel)
# or distributed/... (distributed's tests, from a git snapshot: see DISTRIBUTED_GIT). Default:
# the project's target list. Environment (defaults in brackets):
#   PEER_DIR          results: <slug>.<variant>.xml/.log, modules.tsv, times.tsv [/tmp/peer-suites]
#   PEER_VARIANTS     plain (nothing imported), off (-p peer_plugin, disabled), on [plain off on]
#   PEER_TIMEOUT      pytest-timeout per test, seconds [120]
#   PEER_RERUN        1: rerun each variant's new failures once, to tell flaky ones [1]
#   DISTRIBUTED_GIT   a git dir of dask/distributed (the fetch tool's mirror)
#                     [/work/.mirror/dask+distributed/repo]
#   DISTRIBUTED_REV   the commit to take its tests from [the tag of the installed version]
# Results accumulate in PEER_DIR across invocations; the report covers every module run there.
set -euo pipefail

# Paths: the repository, its virtualenv and the installed packages' directory.
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
PEER_DIR=${PEER_DIR:-/tmp/peer-suites}
PEER_VARIANTS=${PEER_VARIANTS:-plain off on}
PEER_TIMEOUT=${PEER_TIMEOUT:-120}
PEER_RERUN=${PEER_RERUN:-1}
DISTRIBUTED_GIT=${DISTRIBUTED_GIT:-/work/.mirror/dask+distributed/repo}
mkdir -p "$PEER_DIR"

if [ $# -eq 0 ]; then
    set -- dask/tests/test_callbacks.py dask/tests/test_traceback.py dask/tests/test_threaded.py \
        dask/tests/test_local.py dask/tests/test_delayed.py dask/diagnostics/tests \
        dask/array/tests/test_array_core.py \
        distributed/tests/test_worker.py distributed/tests/test_client.py
fi

# Dask's tests run in place from the wheel, under a neutral ini (not this repository's).
printf '[pytest]\nxfail_strict = true\n' >"$PEER_DIR/dask-pytest.ini"

# distributed_src: extract distributed's tests, root conftest.py and pytest config (once).
distributed_src() {
    local src=$PEER_DIR/distributed-src rev
    if [ ! -d "$src" ]; then
        local version
        version=$("$PY" -c 'import distributed; print(distributed.__version__)')
        rev=${DISTRIBUTED_REV:-$version}
        if ! git -C "$DISTRIBUTED_GIT" rev-parse -q --verify "$rev^{commit}" >/dev/null; then
            echo "no commit '$rev' in $DISTRIBUTED_GIT (installed distributed $version);" \
                "set DISTRIBUTED_REV to the closest one" >&2
            exit 1
        fi
        mkdir -p "$src.tmp"
        git -C "$DISTRIBUTED_GIT" archive "$rev" conftest.py pyproject.toml distributed/tests |
            tar -x -C "$src.tmp"
        git -C "$DISTRIBUTED_GIT" rev-parse "$rev^{commit}" >"$src.tmp/COMMIT"
        # distributed's tests use pytest-rerunfailures' flaky marker (--strict-markers): install
        # it beside them, not into the virtualenv.
        "$PY" -m pip install -q --no-deps --target "$src.tmp/pytest-deps" pytest-rerunfailures >&2
        mv "$src.tmp" "$src"
    fi
    echo "$src"
}

# run_pytest ROOT VARIANT JUNIT LOG ARGS...: one pytest session in ROOT; returns its status.
run_pytest() {
    local root=$1 variant=$2 junit=$3 log=$4
    shift 4
    local path=$REPO/benchmarks
    [ "$root" = "$SITE" ] || path=$root/pytest-deps
    local opts=(-q --color=no -p no:cacheprovider --timeout "$PEER_TIMEOUT"
        -o timeout_method=signal -o junit_family=xunit1 --junitxml "$junit")
    if [ "$root" = "$SITE" ]; then
        opts+=(-c "$PEER_DIR/dask-pytest.ini" --rootdir "$SITE" --confcutdir "$SITE")
    fi
    # env --default-signal=INT: a script started in the background inherits SIGINT ignored,
    # and Dask's test_threaded.py::test_interrupt then hangs. -P: the working directory
    # (distributed-src holds a distributed/ folder) is not on sys.path.
    local run=(env --default-signal=INT PYTHONPATH="$path" "$PY" -P -m pytest)
    if [ "$variant" != plain ]; then
        run=(env --default-signal=INT PYTHONPATH="$REPO/benchmarks:$path"
            PEER_GPUSTREAMS="$variant" "$PY" -P -m pytest -p peer_plugin)
    fi
    (cd "$root" && "${run[@]}" "${opts[@]}" "$@") >"$log" 2>&1
}

for module in "$@"; do
    case $module in
        distributed/*) root=$(distributed_src) ;;
        dask/*) root=$SITE ;;
        *) echo "module '$module' must start with dask/ or distributed/" >&2 && exit 1 ;;
    esac
    slug=$(echo "${module%/}" | tr '/.' '__')
    # Record the module once (modules.tsv keeps the order of first runs).
    grep -q "^$slug	" "$PEER_DIR/modules.tsv" 2>/dev/null ||
        printf '%s\t%s\n' "$slug" "$module" >>"$PEER_DIR/modules.tsv"
    for variant in $PEER_VARIANTS; do
        start=$(date +%s)
        rc=0
        run_pytest "$root" "$variant" "$PEER_DIR/$slug.$variant.xml" \
            "$PEER_DIR/$slug.$variant.log" "$module" || rc=$?
        seconds=$(($(date +%s) - start))
        # Keep one times.tsv line per run (the latest).
        touch "$PEER_DIR/times.tsv"
        grep -v "^$slug	$variant	" "$PEER_DIR/times.tsv" >"$PEER_DIR/times.tmp" || true
        printf '%s\t%s\t%s\t%s\n' "$slug" "$variant" "$seconds" "$rc" >>"$PEER_DIR/times.tmp"
        mv "$PEER_DIR/times.tmp" "$PEER_DIR/times.tsv"
        echo "$module $variant: ${seconds}s, pytest exit $rc"
        rm -f "$PEER_DIR/$slug.$variant.rerun.xml"
        if [ "$variant" != plain ] && [ "$PEER_RERUN" = 1 ] && [ -f "$PEER_DIR/$slug.plain.xml" ]; then
            mapfile -t ids < <("$PY" "$REPO/benchmarks/peer_compare.py" new "$PEER_DIR" "$slug" "$variant")
            if [ ${#ids[@]} -gt 0 ]; then
                run_pytest "$root" "$variant" "$PEER_DIR/$slug.$variant.rerun.xml" \
                    "$PEER_DIR/$slug.$variant.rerun.log" "${ids[@]}" || true
            fi
        fi
    done
done

if [ -f "$PEER_DIR/distributed-src/COMMIT" ]; then
    echo "distributed tests from commit $(cat "$PEER_DIR/distributed-src/COMMIT")"
fi
"$PY" "$REPO/benchmarks/peer_compare.py" report "$PEER_DIR"
