#!/usr/bin/env bash
# Triton instance starts (target <= 3 s), this code against an earlier commit in one device call: Inception-v4 (timm, fp16, batch 1) served by
# tritonserver, instance starts with this checkout's code and with an earlier one's, interleaved, then the same
# instance start in plain processes by variant (bench/instance_load.py), then the GPU tests given as arguments.
#
# Here, first: .whl/ filled by bench/triton_wheels.sh (grpcio moved out: HTTP only), and the earlier code as
#     mkdir -p .before && git archive <commit> launcher pipeline rewrite | tar -x -C .before
# (.before/ and .whl/ ignored in .git/info/exclude), then on the device, carrying both:
#     bash bench/instance_starts.sh [pytest args...]
set -uo pipefail
source bench/device_env.sh || exit 1
out=${OUT:-/tmp/bench_out}
mkdir -p /tmp/ns_before/parastream "$out"
for d in launcher pipeline rewrite; do ln -sfn "$PWD/.before/$d" /tmp/ns_before/parastream/$d; done
use() {  # which code /tmp/ns/parastream (what the stubs and this shell's Python import) points at
    for d in launcher pipeline rewrite; do ln -sfn "$1/$d" /tmp/ns/parastream/$d; done
}
starts() {
    python3 bench/triton_gpu.py --models inception_v4 --protocols http --starts "$1" --tag "$2" --out "$out" ${3:-} \
        2>&1 | grep -E '^\[\{"model"|Error' | cut -c1-600 | tail -n 6
}
use "$PWD";          starts 3 after1
use "$PWD/.before";  starts 3 before --reuse
use "$PWD";          starts 3 after2 --reuse
PARASTREAM_BEFORE=/tmp/ns_before timeout 120 python3 bench/instance_load.py /tmp/triton_gpu_work/inception_v4.bundle \
    --reps 3 --variants now,before --out "$out" | grep -E "^SUMMARY|error"
if [ $# -gt 0 ]; then
    timeout 280 python3 -m pytest -q --maxfail=3 -p no:cacheprovider "$@" 2>&1 | tail -n 25
fi
