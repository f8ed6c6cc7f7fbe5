#!/usr/bin/env bash
# Before and after in one device call, on a two-GPU host: bench/corpus_gpu.py with the same arguments, this
# checkout's parastream on GPU 0 and an earlier tree's on GPU 1, side by side (the bench code is this
# checkout's in both).  The earlier tree is unpacked here first and carried with the call:
#
#     mkdir .before && git archive BASE core launcher pipeline rewrite | tar -x -C .before   # .before/ is ignored
#     run (carry .whl and .before):
#         source bench/device_env.sh; OUT=$OUT bash bench/ab_gpus.sh --models nasnetalarge --workers 1 --fresh-loads 1
#
# Each side writes its figures under $OUT/after and $OUT/before, its log beside them; both folders are then packed
# into $OUT/ab_gpus.tgz (a device call brings back at most 8 files: a side's JSON was left behind once).
set -u
[ -d .before/pipeline ] || { echo "ab_gpus.sh: no .before/ tree (see the comment at the top)" >&2; exit 2; }
mkdir -p /tmp/nsb/parastream
for d in core launcher pipeline rewrite; do ln -sfn "$PWD/.before/$d" /tmp/nsb/parastream/$d; done
out=${OUT:-/tmp/ab_gpus}
mkdir -p "$out/after" "$out/before"
CUDA_VISIBLE_DEVICES=0 python3 bench/corpus_gpu.py "$@" --work /tmp/ab_w0 --out "$out/after" > "$out/after.log" 2>&1 &
after=$!
CUDA_VISIBLE_DEVICES=1 PYTHONPATH=/tmp/nsb:/tmp/site python3 bench/corpus_gpu.py "$@" --work /tmp/ab_w1 \
    --out "$out/before" > "$out/before.log" 2>&1 &
before=$!
wait $after; rc_after=$?
wait $before; rc_before=$?
echo "after: rc $rc_after; before: rc $rc_before"
tail -n 25 "$out/after.log" "$out/before.log"
(cd "$out" && tar czf ab_gpus.tgz after before && rm -rf after before)
