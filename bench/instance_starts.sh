#!/usr/bin/env bash
# Triton instance starts (target <= 3 s) of one model (MODEL, a timm name; default inception_v4; fp16, batch 1),
# served by tritonserver, with this checkout's code and, where .before/ holds an earlier commit's, with that one's,
# interleaved; then the same instance start in plain processes by variant (bench/instance_load.py, VARIANTS), then
# the GPU tests given as arguments.  BUNDLE (a bundle folder with its model.onnx beside as BUNDLE/../MODEL.onnx,
# e.g. /tmp/load_breakdown/now/nasnetalarge) is served instead of building one.
#
# Here, first: .whl/ filled by bench/triton_wheels.sh (grpcio moved out: HTTP only), and for the A/B the earlier
# code as
#     mkdir -p .before && git archive <commit> core launcher pipeline rewrite | tar -x -C .before
# (.before/ and .whl/ ignored in .git/info/exclude), then on the device, carrying both:
#     MODEL=nasnetalarge bash bench/instance_starts.sh [pytest args...]
set -uo pipefail
source bench/device_env.sh || exit 1
out=${OUT:-/tmp/bench_out}
model=${MODEL:-inception_v4}
work=/tmp/triton_gpu_work
mkdir -p "$out" "$work"
if [ -n "${BUNDLE:-}" ]; then  # a bundle built already: served as triton_gpu.py's own (--reuse)
    rm -rf "$work/$model.bundle" && cp -r "$BUNDLE" "$work/$model.bundle" && cp "$(dirname "$BUNDLE")/../$model.onnx" "$work/$model.onnx"
fi
before=0
if [ -d .before/launcher ]; then
    before=1
    mkdir -p /tmp/ns_before/parastream
    for d in core launcher pipeline rewrite; do [ -d ".before/$d" ] && ln -sfn "$PWD/.before/$d" /tmp/ns_before/parastream/$d; done
fi
use() {  # which code /tmp/ns/parastream (what the stubs and this shell's Python import) points at
    for d in core launcher pipeline rewrite; do [ -d "$1/$d" ] && ln -sfn "$1/$d" /tmp/ns/parastream/$d; done
}
starts() {
    python3 bench/triton_gpu.py --models "$model" --protocols http --starts "$1" --tag "$2" --out "$out" ${3:-} \
        2>&1 | grep -E '^\[\{"model"|Error' | cut -c1-600 | tail -n 6
}
reuse=${BUNDLE:+--reuse}
use "$PWD";              starts 3 after1 "$reuse"
if [ $before = 1 ]; then
    use "$PWD/.before";  starts 3 before --reuse
    use "$PWD";          starts 3 after2 --reuse
fi
PARASTREAM_BEFORE=/tmp/ns_before timeout 150 python3 bench/instance_load.py "$work/$model.bundle" --reps 3 \
    --variants "${VARIANTS:-now$([ $before = 1 ] && echo ,before)}" --out "$out" | grep -E "^SUMMARY|error"
if [ $# -gt 0 ]; then
    timeout 280 python3 -m pytest -q --maxfail=3 -p no:cacheprovider "$@" 2>&1 | tail -n 25
fi
