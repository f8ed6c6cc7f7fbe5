#!/usr/bin/env bash
# Before and after in one device call on a one-GPU host: one model exported once, then `parastream build` of it
# (torch, fp16, the build's defaults: its search measured on the GPU) with this checkout's parastream and with an
# earlier tree's, one after the other on GPU 0 (this checkout's first: a call cut short keeps it), each build
# with empty Inductor and Triton caches of its own.
# What the two-GPU `ab_gpus.sh` gives side by side, for the build alone (no torch.compile, no fresh loads):
#
#     mkdir .before && git archive BASE core launcher pipeline rewrite | tar -x -C .before   # .before/ is ignored
#     run (carry .whl and .before):
#         source bench/device_env.sh; OUT=$OUT bash bench/ab_one_gpu.sh nasnetalarge [BUILD ARGS...]
#
# MODEL is a name of bench/gpu.py's make_model (exported here) or an ONNX file's path (built as it is).
# SIDES="after" builds this checkout's alone (no .before/ needed).
# Each side's report.json and its `--json` line land in $OUT/before and $OUT/after, packed into $OUT/ab_one_gpu.tgz.
set -u
sides=${SIDES:-after before}
[[ "$sides" != *before* || -d .before/pipeline ]] || { echo "ab_one_gpu.sh: no .before/ tree (see the comment at the top)" >&2; exit 2; }
model=${1:?model: a bench/gpu.py make_model name, or an ONNX file}; shift
mkdir -p /tmp/nsb/parastream
for d in core launcher pipeline rewrite; do ln -sfn "$PWD/.before/$d" /tmp/nsb/parastream/$d; done
out=${OUT:-/tmp/ab_one_gpu}
work=/tmp/ab_one_gpu_work
rm -rf "$work" && mkdir -p "$work" "$out/before" "$out/after"
if [[ "$model" == *.onnx ]]; then
    cp "$model" "$work/" && model=$(basename "$model" .onnx)
else python3 - "$model" "$work" <<'PY' || exit 1
import sys, time
sys.path.insert(0, "bench")
from gpu import export, make_model
from pathlib import Path
name, work = sys.argv[1], Path(sys.argv[2])
model, inputs = make_model(name, 1)
t0 = time.perf_counter()
export(model, inputs, work / f"{name}.onnx")
print(f"exported {name} in {time.perf_counter() - t0:.1f} s", flush=True)
PY
fi
for side in $sides; do
    if [ "$side" = before ]; then path=/tmp/nsb:/tmp/site; else path=$PYTHONPATH; fi
    caches="$work/caches-$side"
    t0=$(date +%s.%N)
    CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$path TORCHINDUCTOR_CACHE_DIR="$caches/inductor" TRITON_CACHE_DIR="$caches/triton" \
        python3 -m parastream.pipeline.cli build "$work/$model.onnx" -o "$work/$side" --backend torch --precision fp16 \
        --force --json "$@" > "$out/$side/build.json" 2> "$out/$side/build.log"
    rc=$?
    echo "$side: rc $rc, $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
    [ -f "$work/$side/report.json" ] && cp "$work/$side/report.json" "$out/$side/report.json"
done
(cd "$out" && tar czf ab_one_gpu.tgz $sides && rm -rf before after)
