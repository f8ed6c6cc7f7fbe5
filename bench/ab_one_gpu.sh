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
# GPU=N builds on that GPU (default 0) and WORK=DIR works there (default /tmp/ab_one_gpu_work): two runs side by
# side on a two-GPU host, one model each, with their own GPU and WORK.
# SIDES="after" builds this checkout's alone (no .before/ needed).
# BEFORE=. builds the before side from this checkout too (no .before/ needed), and AFTER_ARGS / BEFORE_ARGS add
# build arguments to one side: a build option timed against the default on one tree, e.g.
#     BEFORE=. AFTER_ARGS=--head-engine REPS=2 SIDE_BY_SIDE=1 OUT=$OUT bash bench/ab_one_gpu.sh mixnet_s
# REPS=N builds each side N times, interleaved, the sides' order reversed every other round (after before before
# after ...): one pair of builds is not enough, the same tree's NASNet-A Large build varied by up to 9 s between
# machines of one kind, and the first build on a fresh machine was the slowest.
# Each build's report.json, its `--json` line and its log are packed into $OUT/SIDE.tgz (REPS=1) or
# $OUT/SIDE.ROUND.tgz as soon as it is built, and all of them into $OUT/ab_one_gpu.tgz at the end; a table of
# every build's stages, candidates measured and compile work is printed at the end,
# and with SIDE_BY_SIDE=1 every build's bundle timed side by side (bench/bundles_side_by_side.py; LOADS=N loads
# each N times, two loads of one plan differing by up to ~5%).
# BUILD_TIMEOUT=S ends a build after S seconds (rc 124; its log, packed as any build's, says how far it got).  A
# `timeout` around the whole script instead ends the script and leaves its build running, beside what runs next.
# FRESH_LOADS=N: then every build's bundle loaded N times in fresh processes (rep by rep, the builds interleaved),
# each with its own side's code and empty Inductor and Triton caches: `import torch` + `parastream.launcher.load`
# (what issue 27's start figure counts; only that API, which every tree has), then 200 replays back to back.  For
# a before tree too old to load in this checkout's process, where SIDE_BY_SIDE cannot time it.
set -u
sides=${SIDES:-after before}
[[ "$sides" != *before* || "${BEFORE:-}" = . || -d .before/pipeline ]] || { echo "ab_one_gpu.sh: no .before/ tree (see the comment at the top)" >&2; exit 2; }
model=${1:?model: a bench/gpu.py make_model name, or an ONNX file}; shift
mkdir -p /tmp/nsb/parastream
for d in core launcher pipeline rewrite; do ln -sfn "$PWD/.before/$d" /tmp/nsb/parastream/$d; done
out=${OUT:-/tmp/ab_one_gpu}
work=${WORK:-/tmp/ab_one_gpu_work}
rm -rf "$work" && mkdir -p "$work" "$out"
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
code_path() {  # the PYTHONPATH a side's build and loads run with: the before side's tree, unless BEFORE=.
    if [ "$1" = before ] && [ "${BEFORE:-}" != . ]; then echo /tmp/nsb:/tmp/site; else echo "${PYTHONPATH:-}"; fi
}
reps=${REPS:-1}
dirs=()
for ((rep = 1; rep <= reps; rep++)); do
    order=$sides
    (( rep % 2 == 0 )) && order=$(echo $sides | tr ' ' '\n' | tac | tr '\n' ' ')
    for side in $order; do
        name=$side; (( reps > 1 )) && name=$side.$rep
        dirs+=("$name")
        mkdir -p "$work/reports/$name"
        path=$(code_path "$side")
        if [ "$side" = before ]; then side_args=${BEFORE_ARGS:-}; else side_args=${AFTER_ARGS:-}; fi
        caches="$work/caches-$name"
        t0=$(date +%s.%N)
        CUDA_VISIBLE_DEVICES=${GPU:-0} PYTHONPATH=$path TORCHINDUCTOR_CACHE_DIR="$caches/inductor" TRITON_CACHE_DIR="$caches/triton" \
            ${BUILD_TIMEOUT:+timeout -k 10 $BUILD_TIMEOUT} python3 -m parastream.pipeline.cli build "$work/$model.onnx" -o "$work/bundles/$name" --backend torch --precision fp16 \
            --force --json $side_args "$@" > "$work/reports/$name/build.json" 2> "$work/reports/$name/build.log"
        rc=$?
        echo "$name: rc $rc, $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s"
        [ -f "$work/bundles/$name/report.json" ] && cp "$work/bundles/$name/report.json" "$work/reports/$name/report.json"
        # packed as soon as built: a call cut short by its time limit still brings back every build's files in one
        tar czf "$out/$name.tgz" -C "$work/reports" "$name"
    done
done
# one row per build, in the order built: where its time went and how much compiling it did
python3 - "$work/reports" "${dirs[@]}" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'build':<10} {'stages s':>8} {'load':>5} {'search':>6} {'engines':>7} {'verify':>6} {'measured':>8} "
      f"{'worker-s':>8} {'1st job s':>9} {'last job s':>10}")
for name in sys.argv[2:]:
    try:
        r = json.loads((out / name / "report.json").read_text())
    except (OSError, ValueError):
        print(f"{name:<10} (no report.json)")
        continue
    st = r.get("stage_seconds") or {}
    bc = r.get("background_compiles") or {}
    labels = (bc.get("by_label") or {}).values()
    first = min((x["first_started_s"] for x in labels if "first_started_s" in x), default=float("nan"))
    print(f"{name:<10} {sum(st.values()):8.1f} {st.get('load', 0):5.1f} {st.get('search', 0):6.1f} "
          f"{st.get('engines', 0):7.1f} {st.get('verify', 0):6.1f} {len((r.get('search') or {}).get('measured_in_order') or []):8d} "
          f"{sum(x.get('worker_s', 0) for x in labels):8.0f} {first:9.1f} {bc.get('last_done_s', float('nan')):10.1f}")
    # what each timed round kept: builds whose rounds kept the same are the pairs to compare bundles by
    print(" " * 11 + "; ".join(f"{c.get('choice')}: {c.get('won')}{' (sampled)' if 'sample' in c else ''}"
                                for c in (r.get("measured_choices") or {}).get("rounds") or []))
PY
# SIDE_BY_SIDE=1: every build's bundle loaded in one process and their replays timed in alternating blocks, so
# that one call gives the build's and the bundle's before and after. Every build, not one a side: two builds of
# one tree can take different decisions (a round whose rivals lie within its 1%), and a pair of builds that took
# the same decisions is the one that shows what the change itself costs.
if [ "${SIDE_BY_SIDE:-0}" = 1 ]; then
    named=()
    for d in "${dirs[@]}"; do [ -f "$work/bundles/$d/manifest.json" ] && named+=("$d=$work/bundles/$d"); done
    (( ${#named[@]} >= 2 )) && CUDA_VISIBLE_DEVICES=${GPU:-0} python3 bench/bundles_side_by_side.py "${named[@]}" --loads "${LOADS:-1}" --out "$out" 2>&1 | tail -1
fi
if (( ${FRESH_LOADS:-0} > 0 )); then
    for ((rep = 1; rep <= FRESH_LOADS; rep++)); do
        for d in "${dirs[@]}"; do
            [ -f "$work/bundles/$d/manifest.json" ] || continue
            path=$(code_path "${d%%.*}")
            caches=$(mktemp -d)
            CUDA_VISIBLE_DEVICES=${GPU:-0} PYTHONPATH=$path TORCHINDUCTOR_CACHE_DIR="$caches/inductor" TRITON_CACHE_DIR="$caches/triton" \
                timeout 300 python3 - "$work/bundles/$d" "$d" "$rep" <<'PY' | tee -a "$work/reports/fresh_loads.jsonl"
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from parastream.launcher import load
la = load(sys.argv[1])
t2 = time.perf_counter()
for _ in range(20):
    la.launch()
la.synchronize()
t3 = time.perf_counter()
for _ in range(200):  # replays back to back: the GPU's time per replay
    la.launch()
la.synchronize()
print(json.dumps({"build": sys.argv[2], "rep": int(sys.argv[3]), "import_torch_s": round(t1 - t0, 3),
                  "load_s": round(t2 - t1, 3), "total_s": round(t2 - t0, 3),
                  "replay_ms": round((time.perf_counter() - t3) / 200 * 1e3, 4)}), flush=True)
PY
            rm -rf "$caches"
        done
    done
    cp "$work/reports/fresh_loads.jsonl" "$out/" 2>/dev/null
fi
tar czf "$out/ab_one_gpu.tgz" -C "$work/reports" "${dirs[@]}" && (cd "$out" && for d in "${dirs[@]}"; do rm -f "$d.tgz"; done)
