#!/usr/bin/env bash
# The prepared GPU run (issue 40, benchmarks/gpu_check.py) on a lent device, in two
# calls made back to back (the machine stays warm 30 s after a call).
#
#   here, once (needs PyPI):  bash benchmarks/device_gpu.sh prepare
#   there:  run(command="bash benchmarks/device_gpu.sh first", carry=[".gpu/a"], timeout_s=90)
#   then at once:  run(command="bash benchmarks/device_gpu.sh second", carry=[".gpu/b"],
#               timeout_s=420)
#   a rerun of the second call finds the build done and the model converted.
#
# Why two: at most 64 MiB travel with a call; the wheels (tokenrelay's closure for the
# worker phase, exllamav2 0.3.2) and the bundled 94 MiB GGUF do not fit one.
# `prepare` (benchmarks/device_carry.py --gpu) splits them to fit, checked by size.
# The first call installs the wheels and starts exllamav2's extension build (154 s on
# 16 cores in session 22) in a session of its own, so it runs on between the calls. The
# second joins the GGUF and runs gpu_check.py, whose conversion and transformers
# reference overlap the build's end; each phase's JSON lands in $OUT as it ends.
#
# One TORCH_CUDA_ARCH_LIST and one TORCH_EXTENSIONS_DIR for every process: torch's JIT
# keys the build on its flags, and a process with another list rebuilds the extension
# (session 22's check timed out so). A stale build `lock` (a build killed by a call's
# timeout) would make the next import wait forever: removed unless a build still runs.
#
# Output under $OUT (8 files, what comes back at most): log.txt, 01-convert.json ...
# 06-worker.json (the compile phase's holds the build log's tail), summary.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-python3}
SITE=${SITE:-/tmp/tokenrelay-site}
STATE=${STATE:-/tmp/tokenrelay-gpu}
RUN_S=${RUN_S:-400}
export TORCH_CUDA_ARCH_LIST=${ARCHS:-9.0+PTX}  # the H100's and H200's, as exllamav2 sets it
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/tokenrelay-torch-ext}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

log() { echo "== $(date -u +%H:%M:%S) $*"; }

prepare() {
    .venv/bin/python benchmarks/device_carry.py --gpu --dest .gpu || return 3
    du -sh .gpu/a .gpu/b
}

building() { [ -f "$STATE/compile.pid" ] && kill -0 "$(cat "$STATE/compile.pid")" 2>/dev/null; }

first() {
    log "host: $(nproc) cores, $($PY --version 2>&1); $(nvidia-smi -L 2>&1 | head -1)"
    log "torch: $($PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1)"
    log "transformers: $($PY -c 'import transformers; print(transformers.__version__)' 2>&1 | tail -1)"
    log "flash-attn: $($PY -c 'import flash_attn; print(flash_attn.__version__)' 2>&1 | tail -1)"
    mkdir -p "$STATE"
    cp .gpu/a/part.aa "$STATE"/ || return 3
    log "installing $(ls .gpu/a/whl/*.whl | wc -l) wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .gpu/a/whl/*.whl || return 3
    if building; then
        log "a build is already running (pid $(cat "$STATE/compile.pid"))"
        return 0
    fi
    if [ "$(cat "$STATE/compile.rc" 2>/dev/null)" = 0 ]; then
        log "the extension is already built"
        return 0
    fi
    find "$TORCH_EXTENSIONS_DIR" -name lock -delete 2>/dev/null
    rm -f "$STATE/compile.rc"
    setsid bash -c "cd '$PWD' && export PYTHONPATH='$SITE' MAX_JOBS=$(nproc); \
        start=\$(date +%s); $PY -c 'import exllamav2, exllamav2.ext' >'$STATE/compile.log' 2>&1; \
        rc=\$?; echo \"compile rc=\$rc in \$(( \$(date +%s) - start )) s\" >>'$STATE/compile.log'; \
        echo \$rc >'$STATE/compile.rc'" </dev/null >/dev/null 2>&1 &
    echo $! >"$STATE/compile.pid"
    log "build started in the background (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
}

second() {
    cat "$STATE"/part.aa .gpu/b/part.ab >"$STATE/model.gguf" || return 3
    if [ "$(sha256sum "$STATE/model.gguf" | cut -d' ' -f1)" != "$(cat .gpu/b/sha256)" ]; then
        log "the joined GGUF's sha256 differs"
        return 3
    fi
    log "gpu_check (build: $(building && echo running || echo "rc $(cat "$STATE/compile.rc" 2>/dev/null)"))"
    PYTHONPATH="$SITE" timeout "$RUN_S" "$PY" -m benchmarks.gpu_check --out "$OUT" \
        --gguf "$STATE/model.gguf" --work-dir "$STATE/work" --compile-rc "$STATE/compile.rc"
    log "gpu_check rc=$?"
}

case "${1:-}" in
prepare) prepare ;;
first) first 2>&1 | tee "$OUT/log.txt" ;;
second) second 2>&1 | tee "$OUT/log.txt" ;;
*) echo "usage: $0 prepare|first|second" >&2; exit 2 ;;
esac
