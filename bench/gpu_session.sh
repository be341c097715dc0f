#!/usr/bin/env bash
# GPU measurements for bench/RESULTS.md, one recipe per question, each fitting one 10-minute
# device call. Runs on the GPU machine (no internet) over a copy of this tree:
#
#   bash bench/gpu_session.sh help            # the recipes, one line each
#   bash bench/gpu_session.sh RECIPE [ARGS]   # e.g. soak 4, coldstart-drill, ab /path/to/old/checkout
#
# A recipe writes its logs straight into $OUT/RECIPE/ (default OUT=./gpu-out; a call cut by its
# time limit still returns them; emptied first), keeps its scratch (run directories, compile caches,
# checkpoints) in /tmp/bench-RECIPE/, wiped when it starts (a cold start is cold on a machine
# kept warm between calls), packs every run's log and JSON line from there into
# $OUT/RECIPE/runs.tgz (no artifacts, traces or checkpoints), and prints its figure lines last.
# The wheels come in through PYTHONPATH, kept as given; this tree goes before them.
set -uo pipefail
cd "$(dirname "$0")/.."

help() {
  cat <<'EOF'
usage: bash bench/gpu_session.sh RECIPE [ARGS]   (logs in $OUT/RECIPE/, default OUT=gpu-out)
  reference [WARM]                1 GPU: reference size, a cold start then WARM warm ones (default 1), 30 steps: tok/s, MFU, first step; nvidia-smi under load
  coldstart-drill [SAFE] [UNSAFE] 1 GPU: threaded cold start (1 target + 3 drafter threads), SAFE fresh caches with the discipline (default 5), UNSAFE without (default 3)
  coldstart-share [SHARED] [PER] [UNSAFE] [PROBE] [WARM]
                                  1 GPU: the drill at the qwen3-0.6b shapes (3 drafter threads, 2 buckets, block 8), SHARED fresh-cache starts with compile.share shared (default 3), PER with per_thread (default 2), UNSAFE with the discipline off (default 0), then WARM starts of each mode on its last cold start's cache (default 0); the start-up probe of torch's private uses first unless PROBE is 0
  coldstart-helpers [PAIRS]       1 GPU: the drill at the qwen3-0.6b shapes (3 drafter threads, 2 buckets, block 8), fresh caches, warm-up helpers on (compile.warmup_processes unset) and off (0) alternated PAIRS times (default 2), then a warm start with helpers on
  soak [MIN] [OLD] [SHARE]        1 GPU: the small and qwen3-0.6b soaks at once for MIN minutes (default 8.5), compile.share SHARE (default: the config's); with OLD (a checkout, or - for none), the small one on OLD's trainer too
  ab OLD                          1 GPU: this tree against OLD (another checkout) on one compile cache: a cold start, then 40 warm steps each, alternated, twice
  artifacts                       1 GPU: a cold start, then warm and artifact starts alternated (three each, 30 steps, one cache); the bytecode unpack alone
  variants [SETTING ...]          1 GPU: a cold start, then 40 warm steps per SETTING (flags of bench.trainer.reference, e.g. "--loss-chunk 2048"; default: the past ones)
  timeline                        1 GPU: a cold 30-step run with 3 steps profiled, where their GPU time and idle gaps go; two warm starts
  imports                         1 GPU: where a start's import time goes: torch's bytecode, -X importtime, the CUDA context beside the imports, cold imports with and without bytecode compiled ahead, a warm start's imports
  restart                         1 GPU: restart downtime, small preset: a cold start, then two resumes from its checkpoint
  quality                         1 GPU: the small preset on the synthetic task, 300 steps, the drafter's residual in fp32 and in the compute dtype
  loss                            1 GPU: the loss chunk's compiled kernels alone, the triton kernel's launch configurations, the chunk's two compiled forms; the loss region per chunk and per reference step against its floor
  flash [LAUNCHES] [PAIRS]        1 GPU, flash-attn-4 importable: its tests, parity and a canary of LAUNCHES (default 10000) against the Triton kernels, then the trainer at the reference size: a cold start (compile.flex_kernel auto), then PAIRS (default 1) of 40 warm steps auto / triton
  masks                           1 GPU: BlockMask builders; sliding masks of both semantics against the dense mask; flex_attention on a sliding layer of each
  regenerate                      1 GPU: regeneration tokens/s per batch size (qwen3-0.6b); regenerate -> train -> eval on held-out prompts (tiny-cycle)
  multigpu [T+D] [FLAGS ...]      T+D GPUs (default 1+1; 2+2 on 4, 5+3 on 8): 3 cold starts and a warm one, 200 steps; FLAGS go to bench.trainer.multigpu
  placement                       2 GPUs: reference size split 1+1, then both GPUs shared, 30 steps each; dflashctl's placement advice from each
  e2e                             1-2 GPUs: dflashctl on the machine's own host: launch, SIGKILL the trainer, the supervised restart, eval; what the operator sees
  help                            this list
EOF
}

recipe=${1:-}
[ $# -gt 0 ] && shift
case "$recipe" in
  help|-h|--help) help; exit 0 ;;
  ab) [ $# -ge 1 ] || { echo "usage: bash bench/gpu_session.sh ab OLD (another checkout of this repository)" >&2; exit 2; } ;;
  reference|coldstart-drill|coldstart-share|coldstart-helpers|soak|artifacts|variants|timeline|imports|restart|quality|loss|masks|regenerate|\
  multigpu|placement|e2e|flash) ;;
  *) help >&2; exit 2 ;;
esac
out=${OUT:-gpu-out}
w="$out/$recipe"         # logs, captures and figures: what comes back
tmp="/tmp/bench-$recipe"  # scratch
rm -rf "$w" "$tmp"; mkdir -p "$w" "$tmp"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())' | tee "$w/versions.txt"

capture() {  # capture SECONDS NAME: nvidia-smi under load after SECONDS, for tests/fixtures/nvidia-smi
  sleep "$1"
  nvidia-smi > "$w/$2-plain.txt"
  nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw,power.limit,clocks.sm \
    --format=csv,noheader,nounits > "$w/$2-query.csv"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits > "$w/$2-apps.csv"
}

pack() {  # every run's log and JSON line in the scratch folder, small enough to come back
  tar czf "$w/runs.tgz" --exclude='*.bin' --exclude='profile.json' --exclude='shards*' --exclude='checkpoints' \
    --exclude='compile-cache*' --exclude='cache' --exclude='cache-*' --exclude='unpack-*' --exclude='pycache' \
    -C "$tmp" . 2>/dev/null
}

trainer_bench() {  # trainer_bench LIMIT TREE ARGS...: TREE's own trainer bench (its bench/bench_trainer.py
  local limit=$1 tree=$2  # in a checkout from before bench/ was a package), cut after LIMIT seconds
  shift 2
  if [ -f "$tree/bench/trainer/reference.py" ]; then
    (cd "$tree" && timeout "$limit" python3 -m bench.trainer.reference "$@")
  else
    timeout "$limit" python3 "$tree/bench/bench_trainer.py" "$@"
  fi
}

cold_start() {  # cold_start LIMIT STEPS: a cold start at the reference size filling $tmp/cache ($w/ref.log)
  timeout "$1" python3 -m bench.trainer.reference --runs cold --steps "$2" --timeout $(($1 - 10)) \
    --work-dir "$tmp/ref" --cache-dir "$tmp/cache" > "$w/ref.log" 2>&1
}

summaries() {  # summaries LOG: the cold start's summary, then LOG's "== " lines, each with its run's summary
  tail -n 1 "$w/ref.log" | cut -c1-500
  grep -h -e '^== ' -e '"summary"' "$1" | cut -c1-500
}

checkout() {  # checkout DIR: another checkout's absolute path (for ab and soak's OLD)
  [ -d "$1/trainer" ] || { echo "$1: not a checkout of this repository (no trainer/)" >&2; exit 2; }
  (cd "$1" && pwd)
}

case "$recipe" in
  reference)
    runs=cold; for _ in $(seq "${1:-1}"); do runs+=,warm; done
    ( m="$tmp/1-warm/metrics.jsonl"  # capture once the warm run has logged 8 steps (steady state)
      until [ "$(cat "$m" 2>/dev/null | wc -l)" -ge 8 ]; do sleep 1; done
      capture 0 h200-train ) &
    watcher=$!
    timeout 560 python3 -m bench.trainer.reference --runs "$runs" --steps 30 --timeout 150 --work-dir "$tmp" \
      > "$w/reference.log" 2>&1
    kill "$watcher" 2>/dev/null
    wait
    pack
    tail -n 1 "$w/reference.log"
    ;;
  coldstart-drill)
    safe=${1:-5} unsafe=${2:-3}
    if [ "$safe" -gt 0 ]; then
      timeout $((60 * safe)) python3 -m bench.trainer.coldstart --cold "$safe" --warm 0 --steps 6 --timeout 58 \
        --work-dir "$tmp/safe" > "$w/coldstart.log" 2>&1
    fi
    if [ "$unsafe" -gt 0 ]; then
      timeout $((57 * unsafe)) python3 -m bench.trainer.coldstart --unsafe --cold "$unsafe" --warm 0 --steps 6 \
        --timeout 52 --work-dir "$tmp/unsafe" > "$w/coldstart-unsafe.log" 2>&1
    fi
    pack
    tail -n 1 "$w"/coldstart*.log
    ;;
  coldstart-share)
    shared=${1:-3} per=${2:-2} unsafe=${3:-0} warm=${5:-0}
    if [ "${4:-1}" != 0 ]; then
      python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/trainer/test_torch_api.py > "$w/torch-api.log" 2>&1
      tail -n 1 "$w/torch-api.log"
    fi
    drill() {  # drill NAME STARTS WARM [FLAGS...]
      local name=$1 starts=$2 warm=$3; shift 3
      [ "$starts" -gt 0 ] || return 0
      timeout $((150 * starts + 60 * warm)) python3 -m bench.trainer.coldstart --preset qwen3-0.6b \
        --layer-types sliding,full,sliding --block 8 --buckets 512,1024 --cold "$starts" --warm "$warm" --steps 6 \
        --timeout 140 "$@" --work-dir "$tmp/$name" > "$w/coldstart-$name.log" 2>&1
    }
    drill shared "$shared" "$warm" --share shared
    drill per_thread "$per" "$warm" --share per_thread
    drill unsafe "$unsafe" 0 --share per_thread --unsafe
    grep -h "compile:" "$tmp"/*/cold*.log | sort | uniq -c | head -n 20 > "$w/compile-lines.txt"
    pack
    tail -n 1 "$w"/coldstart-*.log
    ;;
  coldstart-helpers)
    pairs=${1:-2}
    for i in $(seq "$pairs"); do
      for mode in on off; do
        flags=(); [ "$mode" = off ] && flags=(--warmup-processes 0)
        warm=0; [ "$mode" = on ] && [ "$i" = "$pairs" ] && warm=1
        timeout $((150 + 60 * warm)) python3 -m bench.trainer.coldstart --preset qwen3-0.6b \
          --layer-types sliding,full,sliding --block 8 --buckets 512,1024 --cold 1 --warm "$warm" --steps 6 \
          --timeout 140 "${flags[@]}" --work-dir "$tmp/$mode$i" > "$w/coldstart-$mode$i.log" 2>&1
        echo "$mode$i: $(grep -h '"kind"' "$w/coldstart-$mode$i.log" | python3 -c 'import json,sys; print([(r["kind"], r.get("start_to_first_step_s"), r.get("warmup_s"), r.get("recompiles"), r.get("exit_code")) for r in map(json.loads, sys.stdin)])')"
      done
    done
    grep -h "warm-up helper\|compile: serialized\|imports:" "$tmp"/*/*.log > "$w/helper-lines.txt" 2>/dev/null
    pack
    ;;
  soak)
    min=${1:-8.5} old= share=()
    [ -n "${2:-}" ] && [ "$2" != - ] && { old=$(checkout "$2") || exit 2; }
    [ -n "${3:-}" ] && share=(--share "$3")
    if [ -n "$old" ]; then
      python3 -m bench.trainer.soak --preset small --drafters 2 --buckets 1024 --minutes "$min" --repo "$old" \
        --work-dir "$tmp/old" > "$w/soak-small-old.log" 2>&1 &
    fi
    python3 -m bench.trainer.soak --preset small --drafters 2 --buckets 1024 --minutes "$min" "${share[@]}" \
      --work-dir "$tmp/small" > "$w/soak-small.log" 2>&1 &
    python3 -m bench.trainer.soak --preset qwen3-0.6b --drafters 3 --buckets 512,1024 --minutes "$min" "${share[@]}" \
      --work-dir "$tmp/qwen" > "$w/soak-qwen.log" 2>&1 &
    capture 120 soak
    wait
    pack
    tail -n 2 "$w"/soak-*.log
    ;;
  flash)
    launches=${1:-10000} pairs=${2:-1}
    python3 -c 'import flash_attn.cute, importlib.metadata as m; print("flash-attn-4", m.version("flash-attn-4"))' \
      | tee -a "$w/versions.txt" || { echo "flash-attn-4 is not importable here" >&2; exit 2; }
    python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/trainer/test_flash_attention.py > "$w/test.log" 2>&1
    tail -n 1 "$w/test.log"
    timeout 300 python3 -m bench.trainer.flash_check --device cuda --launches "$launches" > "$w/check.log" 2>&1
    grep -v '"progress"' "$w/check.log" | grep '^{' | cut -c1-900
    cold_start 170 30
    for i in $(seq "$pairs"); do
      for setting in "" "--flex-kernel triton"; do
        echo "== ${setting:-(the defaults)}" >> "$w/flash.log"
        # shellcheck disable=SC2086  # a setting is flags and their values: split on spaces
        timeout 90 python3 -m bench.trainer.reference --runs warm --steps 40 --timeout 80 $setting \
          --work-dir "$tmp/f$i${setting:+-t}" --cache-dir "$tmp/cache" >> "$w/flash.log" 2>&1
      done
    done
    grep -h "attention" "$tmp"/ref/*/*.log "$tmp"/ref/*.log 2>/dev/null | sort | uniq -c | head -n 5
    pack
    summaries "$w/flash.log"
    ;;
  ab)
    old=$(checkout "$1") || exit 2
    cold_start 110 30
    for i in 1 2; do
      for tree in this old; do
        dir=$PWD; [ "$tree" = old ] && dir=$old
        echo "== round $i: $tree tree ($dir)" >> "$w/ab.log"
        trainer_bench 60 "$dir" --runs warm --steps 40 --timeout 50 --work-dir "$tmp/ab-$i-$tree" \
          --cache-dir "$tmp/cache" >> "$w/ab.log" 2>&1
      done
    done
    pack
    summaries "$w/ab.log"
    ;;
  artifacts)
    timeout 540 python3 -m bench.trainer.reference --runs cold,warm,artifact,warm,artifact,warm,artifact --steps 30 \
      --timeout 110 --work-dir "$tmp/artifacts" --cache-dir "$tmp/cache-ref" > "$w/artifacts.log" 2>&1
    python3 - "$tmp" <<'PY' > "$w/unpack.log" 2>&1
import glob, json, os, shutil, sys, time
from trainer import bytecode, compile_cache as cc
run = sorted(d for d in glob.glob(os.path.join(sys.argv[1], "artifacts", "*-warm")))[-1]
manifest = cc.read_manifest(run)
data = open(os.path.join(run, cc.CACHE_DIR, manifest["file"]), "rb").read()
archive = cc.part(manifest, data, "bytecode")
for i in range(3):
    prefix = os.path.join(sys.argv[1], f"unpack-{i}")
    shutil.rmtree(prefix, ignore_errors=True)
    t = time.monotonic()
    counts = bytecode.unpack(archive, prefix, "x" * 64)
    print(json.dumps({"unpack": i, "seconds": round(time.monotonic() - t, 3), **counts}))
PY
    pack
    tail -n 1 "$w/artifacts.log"
    tail -n 3 "$w/unpack.log"
    ;;
  variants)
    [ $# -gt 0 ] || set -- "" "--log-every 10" "--residual compute" "--loss-chunk 8192" "--loss-chunk 2048" \
      "--flex-kernel default" "--loss-kernel inductor" "--target-compile off"
    cold_start 130 30
    i=0
    for setting in "$@"; do
      i=$((i + 1))
      echo "== ${setting:-(the defaults)}" >> "$w/variants.log"
      # shellcheck disable=SC2086  # a setting is flags and their values: split on spaces
      timeout 80 python3 -m bench.trainer.reference --runs warm --steps 40 --timeout 70 $setting \
        --work-dir "$tmp/v$i" --cache-dir "$tmp/cache" >> "$w/variants.log" 2>&1
    done
    pack
    summaries "$w/variants.log"
    ;;
  timeline)
    timeout 170 python3 -m bench.trainer.reference --runs cold --steps 30 --profile 3 --timeout 160 \
      --work-dir "$tmp/ref" --cache-dir "$tmp/cache" > "$w/ref.log" 2>&1
    trace=$(find "$tmp/ref" -name profile.json 2>/dev/null | head -1)
    [ -n "$trace" ] && python3 -m bench.trainer.timeline "$trace" --steps 3 --gaps 25 > "$w/timeline.json" 2>&1
    timeout 100 python3 -m bench.trainer.reference --runs warm,warm --steps 12 --timeout 45 \
      --work-dir "$tmp/warm" --cache-dir "$tmp/cache" > "$w/warm.log" 2>&1
    pack
    python3 -c 'import json, sys; t = json.load(open(sys.argv[1]))
print(json.dumps({k: t[k] for k in ("span_ms", "busy_ms", "idle_ms", "gaps_over_50us", "by_kind_ms")}))' \
      "$w/timeline.json" 2>/dev/null || echo "no timeline: see $w/ref.log"
    tail -n 1 "$w/warm.log"
    ;;
  imports)
    python3 - <<'PY' > "$w/bytecode.txt" 2>&1  # is there bytecode for torch, can it be written?
import importlib.util as u, os, sys
s = u.find_spec("torch"); c = u.cache_from_source(s.origin)
print("dont_write_bytecode", sys.flags.dont_write_bytecode, "prefix", sys.pycache_prefix, "torch", s.origin)
print("pyc", c, "exists", os.path.exists(c), "dir writable", os.access(os.path.dirname(s.origin), os.W_OK))
PY
    for i in 1 2; do ( time python3 -c "import torch" ) 2>> "$w/bytecode.txt"; done
    python3 -X importtime -c "import torch, torch._dynamo, torch._inductor.compile_fx, \
      torch.nn.attention.flex_attention, transformers.models.qwen3.modeling_qwen3" 2> "$w/importtime.txt"
    timeout 100 python3 -m bench.trainer.cuda_init --repeat 4 > "$w/cuda-init.log" 2>&1
    timeout 200 python3 -m bench.trainer.imports_ahead --repeat 2 > "$w/imports-ahead.log" 2>&1
    cold_start 150 6
    PYTHONPROFILEIMPORTTIME=1 timeout 60 python3 -m bench.trainer.reference --runs warm --steps 6 --timeout 50 \
      --work-dir "$tmp/imp" --cache-dir "$tmp/cache" > "$w/imp-bench.log" 2>&1
    find "$tmp/imp" -maxdepth 1 -name '*.log' -exec cp {} "$w/" \;
    pack
    cat "$w/bytecode.txt"
    sort -t'|' -k2 -n -r "$w/importtime.txt" | head -n 8
    tail -n 1 "$w/cuda-init.log"
    tail -n 1 "$w/imports-ahead.log"
    grep -h '"summary"' "$w/imp-bench.log" | cut -c1-600
    ;;
  restart)
    timeout 150 python3 -m bench.trainer.reference --preset small --bucket 1024 --anchors 64 --batch-size 2 \
      --drafter-layers 2 --layer-types full,sliding --runs cold,resume,resume --steps 10 --timeout 60 \
      --work-dir "$tmp/restart" > "$w/restart.log" 2>&1
    pack
    tail -n 1 "$w/restart.log"
    ;;
  quality)
    for r in float32 compute; do
      timeout 100 python3 -m bench.trainer.reference --preset small --synthetic --batch-size 8 --anchors 128 \
        --bucket 1024 --runs cold --steps 300 --timeout 90 --residual $r --work-dir "$tmp/q-$r" >> "$w/quality.log" 2>&1
    done
    pack
    grep -h '"run"' "$w/quality.log" | cut -c1-600
    ;;
  loss)
    timeout 120 python3 -m bench.trainer.loss --device cuda --dtype bfloat16 --positions 8192 --hidden 1024 \
      --vocab 151936 --chunk 4096 --compiled --chunk-only --region --kernel-configs 4096x8,8192x8,8192x16,2048x4,4096x4,16384x16 \
      > "$w/loss.log" 2>&1
    timeout 120 python3 - <<'PY' > "$w/loss-ab.log" 2>&1  # the chunk's two compiled forms, in place and fusable
import json, torch, triton
from trainer.loss import chunk_cross_entropy
C, V = 4096, 151936  # one loss chunk of the reference shape
torch.manual_seed(0)
logits = (torch.randn(C, V, device="cuda") * 3).bfloat16()
labels = torch.randint(0, V, (C,), device="cuda")
weight = torch.rand(C, device="cuda")
def in_place(l, y, w): return chunk_cross_entropy(l, y, w, True, in_place=True)
def fusable(l, y, w): return chunk_cross_entropy(l, y, w, True, in_place=False)
out, ms = {}, {}
for fn in (in_place, fusable):
    c = torch.compile(fn, dynamic=False)
    out[fn.__name__] = c(logits, labels, weight)
    ms[fn.__name__] = triton.testing.do_bench(lambda: c(logits, labels, weight), warmup=50, rep=300, return_mode="median")
a, b = out["in_place"], out["fusable"]
print(json.dumps({"chunk_ce_ms": ms, "floor_ms": round(3 * C * V * 2 / 4.8e12 * 1e3, 3),
                  "loss_diff": float((a[0] - b[0]).abs()), "grad_max_diff": float((a[2].float() - b[2].float()).abs().max()),
                  "top1_equal": bool(torch.equal(a[1], b[1]))}))
PY
    tail -n 1 "$w/loss.log"
    tail -n 1 "$w/loss-ab.log"
    ;;
  masks)
    timeout 60 python3 -m bench.trainer.masks --device cuda --batch 16 > "$w/masks-builders.log" 2>&1
    timeout 60 python3 -m bench.trainer.masks --device cuda --ctx 1024 --anchors 64 --builders direct,compiled,eager \
      >> "$w/masks-builders.log" 2>&1
    timeout 120 python3 -m bench.trainer.masks --device cuda --batch 2 --builders direct,eager --check-dense --attention \
      > "$w/masks.log" 2>&1
    for sem in causal_in_block bidirectional; do
      timeout 90 python3 -m bench.trainer.flex --device cuda --variants default --window 512 --semantics $sem \
        >> "$w/flex.log" 2>&1
    done
    grep -h '^{' "$w/masks-builders.log" "$w/masks.log" "$w/flex.log" | cut -c1-400
    ;;
  regenerate)
    timeout 150 python3 -m bench.trainer.regenerate --device cuda --preset qwen3-0.6b --prompts 256 --prompt-len 128 \
      --new-tokens 256 --batch-sizes 1,16,64,128 --batches 2 > "$w/regenerate.log" 2>&1
    timeout 240 python3 -m bench.trainer.regenerate --device cuda --preset tiny-cycle --e2e --steps 300 --samples 512 \
      --holdout 32 --eval-prompts 16 --block-size 16 --bucket 512 --new-tokens 256 --batch-sizes 64 \
      > "$w/regenerate-e2e.log" 2>&1
    grep -h '^{' "$w/regenerate.log" "$w/regenerate-e2e.log" | cut -c1-600
    ;;
  multigpu)
    topo=${1:-1+1}
    [ $# -gt 0 ] && shift
    ( sleep 240; capture 0 "h200x-$topo" ) &
    watcher=$!
    timeout 570 python3 -m bench.trainer.multigpu --topology "$topo" --steps 200 --batch-size 8 --timeout 130 \
      --work-dir "$tmp/runs" "$@" > "$w/multigpu-$topo.log" 2>&1
    kill "$watcher" 2>/dev/null
    wait
    pack
    tail -n 1 "$w/multigpu-$topo.log"
    ;;
  placement)
    timeout 200 python3 -m bench.trainer.reference --target-gpus 0 --drafter-gpus 1 --runs cold --steps 30 \
      --timeout 180 --work-dir "$tmp/split" --cache-dir "$tmp/cache" > "$w/split.log" 2>&1
    timeout 200 python3 -m bench.trainer.reference --target-gpus 0,1 --drafter-gpus 0,1 --runs warm --steps 30 \
      --timeout 180 --work-dir "$tmp/shared" --cache-dir "$tmp/cache" > "$w/shared.log" 2>&1
    python3 - "$tmp" <<'PY' > "$w/advice.log" 2>&1
import glob, json, os, statistics, sys
from dflashctl.core import contract
from dflashctl.supervise.placement import advise
for name in ("split", "shared"):
    path = glob.glob(os.path.join(sys.argv[1], name, "0-*", "metrics.jsonl"))[0]
    lines = [contract.read_metrics_line(l) for l in open(path) if l.strip()]
    steady = [m for m in lines if 16 <= m.step <= 27]
    a = advise([m for m in lines if m.step >= 11], 2)
    print(json.dumps({"run": name, "measured_seq_tok_s": statistics.median(m.extra["seq_tok_s"] for m in steady),
                      "measured_query_tok_s": statistics.median(m.tok_s for m in steady),
                      "mfu": statistics.median(m.extra["mfu"] for m in steady),
                      "mfu_drafter": statistics.median(m.extra["mfu_drafter"] for m in steady),
                      "advice": a.to_dict()}))
PY
    pack
    cat "$w/advice.log"
    ;;
  e2e)
    # dflashctl itself on the GPU machine, on its local host: launch a qwen3-0.6b-shaped run
    # (bench/controller/gpu-e2e.yaml) supervised in the foreground, SIGKILL its trainer once it
    # trains (the supervisor classifies the crash and restarts it from its checkpoint), let it
    # finish, evaluate it, and keep what the operator would see. Needs dflashctl's pure-Python
    # dependencies importable (PYTHONPATH) and tmux.
    export DFLASHCTL_HOME="$tmp/home"
    ngpu=$(nvidia-smi -L | wc -l)
    pb=bench/controller/gpu-e2e.yaml
    if [ "$ngpu" -lt 2 ]; then sed 's/drafter: \[1\]/drafter: [0]/' $pb > "$tmp/gpu-e2e.yaml"; pb=$tmp/gpu-e2e.yaml; fi
    python3 -m dflashctl check local > "$w/check.txt" 2>&1
    python3 -m dflashctl launch "$pb" --foreground > "$w/launch.log" 2>&1 &
    launcher=$!
    run_dir() { ls -d "$DFLASHCTL_HOME"/work/runs/gpu-e2e-* 2>/dev/null | head -1; }
    until [ -n "$(run_dir)" ] && [ "$( (wc -l < "$(run_dir)/metrics.jsonl") 2>/dev/null || echo 0)" -ge 6 ]; do
      sleep 2; kill -0 $launcher 2>/dev/null || break
    done
    capture 0 "h200x$ngpu-train"
    pid=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['pid'])" "$(run_dir)/status.json")
    echo "$(date +%s.%N) SIGKILL trainer $pid" >> "$w/launch.log"
    kill -9 "$pid"
    wait $launcher; echo "launch exit $?" >> "$w/launch.log"
    run=$(basename "$(run_dir)")
    python3 -m dflashctl events "$run" > "$w/events.txt" 2>&1
    python3 -m dflashctl runs > "$w/runs.txt" 2>&1
    COLUMNS=120 python3 -m dflashctl status --once > "$w/status.txt" 2>&1
    python3 -m dflashctl runs --json > "$w/runs.json" 2>&1
    tail -40 "$(run_dir)/trainer.log" > "$w/trainer-tail.txt"
    pack
    tail -n 2 "$w/launch.log"
    cat "$w/runs.txt"
    ;;
esac
