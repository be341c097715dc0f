#!/usr/bin/env bash
# GPU measurements for bench/RESULTS.md, in parts that each fit one 10-minute device call.
# Writes logs (and nvidia-smi captures under load) into $OUT (default ./gpu-out).
#
#   bash bench/gpu_session.sh 1   # threaded cold start: 3 cold + 1 warm (1 target + 3 drafter threads, one GPU)
#   bash bench/gpu_session.sh 2   # the same with the discipline off, 3 cold starts (the hang, with stacks);
#                                 # loss projection and mask building on GPU
#   bash bench/gpu_session.sh 3   # reference size: tok/s, MFU, cold/warm first step; nvidia-smi under load
#   bash bench/gpu_session.sh 4   # 2+ GPUs: topology 1+1, 3 cold starts + 1 warm, 200 steps each
#   bash bench/gpu_session.sh 5   # 4+ GPUs: topology 2+2, the same (scaling against part 4's 1+1 figure)
#   (8 GPUs: python3 bench/bench_multigpu.py --topology 5+3 --steps 200 --batch-size 8, split the same way)
#   bash bench/gpu_session.sh 6   # 2 GPUs, two jobs at once, each pinned to half the CPUs: GPU 0: the loss
#                                 # chunk's two compiled forms, reference size with the target compiled off/on
#                                 # (profile); GPU 1: compile artifacts (cold, warm, artifact on a wiped
#                                 # cache) and restart downtime (small preset); then 1+1 with the target on/off
#   bash bench/gpu_session.sh 7   # 2 GPUs at once: 5 fresh-cache threaded cold starts with the discipline
#                                 # (GPU 0); where import time goes, 3 cold starts without the discipline
#                                 # and restart downtime, small preset (GPU 1)
#   bash bench/gpu_session.sh 8   # 1 GPU: the loss chunk's kernels (triton, inductor) alone; compile artifacts
#                                 # with bytecode (cold, warm, artifact on a wiped cache); reference size,
#                                 # 30 steps, loss kernel triton (profile) then inductor; where import time goes
#   bash bench/gpu_session.sh 9   # 1 GPU: 5 fresh-cache threaded cold starts with the discipline, then 2 without
#   bash bench/gpu_session.sh 10  # 1 GPU: warm and artifact starts alternated (3 each, reference size) after a
#                                 # cold one; the bytecode unpack alone; restart, small preset
#   bash bench/gpu_session.sh 11  # 2 GPUs: reference size split 1+1, then both GPUs shared (a target and a
#                                 # drafter on each), 30 steps each; dflashctl's placement advice from each
#   bash bench/gpu_session.sh 12 [MIN] [OLD]  # 1 GPU: the soak (bench_soak.py), MIN minutes (default 8.5): the small
#                                 # preset with 2 drafter threads and the qwen3-0.6b preset with 3 drafter threads
#                                 # and two buckets, at once; with OLD (another checkout), the small preset on
#                                 # OLD's trainer beside them (the proof that the soak fails where it should)
#   bash bench/gpu_session.sh 13  # 1 GPU: warm and artifact starts alternated (part 10's series); the sliding
#                                 # BlockMask of both semantics against the dense mask, and its attention speed;
#                                 # flex_attention on a sliding layer of each semantics; regeneration tokens/s
#   bash bench/gpu_session.sh 14 [MIN]  # 1 GPU: regeneration tokens/s; regenerate -> train -> eval on held-out
#                                 # prompts (tiny-cycle target); then part 12's two soaks for MIN minutes (default 4)
#   bash bench/gpu_session.sh 15  # 1 GPU: reference size, 30 steps cold and warm; the threaded cold-start drill
#                                 # (5 fresh caches with the discipline, 2 without)
#   bash bench/gpu_session.sh 16 [OLD]  # 1 GPU: the loss kernel's launch configurations; reference size, 30 steps,
#                                 # cold (profile), then warm with flex_attention's default kernel; with OLD
#                                 # (another checkout), the same warm run on OLD's trainer; where import time goes
#   bash bench/gpu_session.sh 17  # 1 GPU: the CUDA context made beside the imports or after them; reference size,
#                                 # 30 steps, a cold start then three warm; 5 fresh-cache threaded cold starts
#   bash bench/gpu_session.sh 18 [MIN]  # 1 GPU: part 12's two soaks for MIN minutes (default 7), then 3 threaded
#                                 # cold starts without the discipline
#   bash bench/gpu_session.sh 19  # 1 GPU: reference size, 30 steps cold with 3 profiled steps and where their GPU
#                                 # time and idle gaps go (bench_timeline.py); two warm starts; one warm start's
#                                 # imports timed (PYTHONPROFILEIMPORTTIME)
#   bash bench/gpu_session.sh 20 [OLD]  # 1 GPU: part 19's cold start and timeline; two warm starts of this tree, then
#                                 # of OLD (another checkout) on the same cache; 40 warm steps with a metrics line
#                                 # every step, every 10 steps, and with the residual in bf16 (the 0.5 ms GIL
#                                 # switch interval it measured on Dec 2 is gone from the trainer)
#   bash bench/gpu_session.sh 21 [MIN] [COLD]  # 1 GPU: part 12's two soaks for MIN minutes (default 3.5); COLD fresh-cache
#                                 # threaded cold starts with the discipline (default 3); the small preset on the
#                                 # synthetic task, 300 steps, with the residual in fp32 and in the compute dtype
#   bash bench/gpu_session.sh 22 OLD [MIN]  # 1 GPU: part 19's cold start and timeline; this tree and OLD (another
#                                 # checkout) alternated, 40 warm steps each, twice; part 12's two soaks for MIN
#                                 # minutes (default 3); 3 fresh-cache threaded cold starts with the discipline
#   bash bench/gpu_session.sh 23  # 1 GPU: part 19's cold start and timeline (the kernels by name); warm and
#                                 # artifact starts alternated, three each, on that cache (30 steps each)
#   bash bench/gpu_session.sh 24 OLD [MIN]  # 1 GPU: a cold start; this tree and OLD (another checkout) alternated,
#                                 # 40 warm steps each, twice; loss chunks of 8192 and 2048 rows; part 12's two
#                                 # soaks for MIN minutes (default 3); everything packed into 24.tgz
#   bash bench/gpu_session.sh 25  # 1 GPU: the threaded cold-start drill: 5 fresh caches with the discipline,
#                                 # then 3 without it
#   bash bench/gpu_session.sh 26  # 1 GPU: part 21's training-quality comparison alone: the small preset on the
#                                 # synthetic task, 300 steps, the residual in fp32 and in the compute dtype
#   (parts 16-26 write their logs straight into $OUT/<part>/)
# Parts 6-10, 13 and 14 leave logs.tgz in $OUT (every bench log and JSON line; no artifacts, traces or checkpoints).
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in 1|2|3|4|5|6|7|8|9|10|11|12|13|14|15|16|17|18|19|20|21|22|23|24|25|26) ;; *) echo "usage: bash bench/gpu_session.sh 1|2|...|26" >&2; exit 2 ;; esac
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())' | tee "$out/versions.txt"

pin() {  # pin CPUS CMD...: run CMD on those CPUs only (the inductor's compile workers follow)
  local cpus=$1; shift
  if command -v taskset >/dev/null; then taskset -c "$cpus" "$@"; else "$@"; fi
}

pack() {  # the logs of parts 6-7, small enough to come back
  tar czf "$out/logs.tgz" --exclude='*.bin' --exclude='profile.json' --exclude='shards*' --exclude='checkpoints' \
    --exclude='compile-cache*' --exclude='cache-*' --exclude='unpack-*' --exclude='pycache' -C "$1" . 2>/dev/null
}

capture() {  # nvidia-smi under load, for tests/fixtures/nvidia-smi; $1: seconds to wait, $2: name
  sleep "$1"
  nvidia-smi > "$out/$2-plain.txt"
  nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw,power.limit,clocks.sm \
    --format=csv,noheader,nounits > "$out/$2-query.csv"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits > "$out/$2-apps.csv"
}

soak() {  # soak MIN OLD DIR: the small and qwen3-0.6b soaks at once for MIN minutes (and OLD's trainer beside them)
  local min=$1 old=$2 dir=$3
  if [ -n "$old" ]; then
    python3 bench/bench_soak.py --preset small --drafters 2 --buckets 1024 --minutes "$min" --repo "$old" \
      --work-dir /tmp/soak-old > "$dir/soak-small-old.log" 2>&1 &
  fi
  python3 bench/bench_soak.py --preset small --drafters 2 --buckets 1024 --minutes "$min" \
    --work-dir /tmp/soak-small > "$dir/soak-small.log" 2>&1 &
  python3 bench/bench_soak.py --preset qwen3-0.6b --drafters 3 --buckets 512,1024 --minutes "$min" \
    --work-dir /tmp/soak-qwen > "$dir/soak-qwen.log" 2>&1 &
  capture 120 soak
  wait
  tail -n 2 "$dir"/soak-*.log
}

profiled() {  # profiled TAG LIMIT GAPS: a cold 30-step run, 3 steps profiled, and where their GPU time goes ($w)
  local tag=$1 limit=$2 gaps=$3 trace
  timeout "$limit" python3 bench/bench_trainer.py --runs cold --steps 30 --profile 3 --timeout $((limit - 10)) \
    --work-dir "/tmp/$tag/ref" --cache-dir "/tmp/$tag/cache" > "$w/ref.log" 2>&1
  trace=$(find "/tmp/$tag/ref" -name profile.json | head -1)
  [ -n "$trace" ] && python3 bench/bench_timeline.py "$trace" --steps 3 --gaps "$gaps" > "$w/timeline.json" 2>&1
}

alternate() {  # alternate TAG OLD: this tree and OLD (another checkout), 40 warm steps each, twice ($w/ab.log)
  local i tree
  for i in 1 2; do
    for tree in . "$2"; do
      timeout 60 python3 "$tree/bench/bench_trainer.py" --runs warm --steps 40 --timeout 50 \
        --work-dir "/tmp/$1/ab-$i-$(basename "$tree")" --cache-dir "/tmp/$1/cache" >> "$w/ab.log" 2>&1
    done
  done
}

residual_quality() {  # the small preset on the synthetic task, 300 steps, the residual in fp32 and bf16 ($w/quality.log)
  local r
  for r in float32 compute; do
    timeout 100 python3 bench/bench_trainer.py --preset small --synthetic --batch-size 8 --anchors 128 --bucket 1024 \
      --runs cold --steps 300 --timeout 90 --residual $r --work-dir "/tmp/q-$r" >> "$w/quality.log" 2>&1
  done
}

artifacts() {  # artifacts DIR TIMEOUT: a cold start, then warm and artifact starts alternated (reference size)
  timeout "$2" python3 bench/bench_trainer.py --runs cold,warm,artifact,warm,artifact,warm,artifact --steps 6 \
    --timeout 110 --work-dir "$1/artifacts" --cache-dir "$1/cache-ref" 2>&1 | tee "$1/artifacts.log"
}

case "${1:-}" in
  1)
    timeout 330 python3 bench/bench_coldstart.py --cold 3 --warm 1 --steps 50 --timeout 150 2>&1 | tee "$out/coldstart.log"
    ;;
  2)
    timeout 400 python3 bench/bench_coldstart.py --unsafe --cold 3 --warm 0 --steps 50 --timeout 120 2>&1 | tee "$out/coldstart-unsafe.log"
    timeout 50 python3 bench/bench_loss.py --device cuda --dtype bfloat16 --positions 8192 --hidden 1024 --vocab 151936 2>&1 | tee "$out/loss.log"
    timeout 60 python3 bench/bench_masks.py --device cuda --batch 16 2>&1 | tee "$out/masks.log"
    timeout 60 python3 bench/bench_masks.py --device cuda --ctx 1024 --anchors 64 --builders direct,compiled,eager 2>&1 | tee -a "$out/masks.log"
    ;;
  3)
    work=$(mktemp -d)  # capture once the warm run has logged 8 steps (steady state)
    ( m="$work/1-warm/metrics.jsonl"; until [ "$(cat "$m" 2>/dev/null | wc -l)" -ge 8 ]; do sleep 1; done
      capture 0 h200-train ) &
    timeout 560 python3 bench/bench_trainer.py --steps 30 --timeout 300 --work-dir "$work" 2>&1 | tee "$out/trainer.log"
    kill %1 2>/dev/null
    wait
    ;;
  4|5)
    topo=$([ "$1" = 4 ] && echo 1+1 || echo 2+2)
    ( sleep 240; capture 0 "h200x-$topo" ) &
    timeout 570 python3 bench/bench_multigpu.py --topology "$topo" --steps 200 --batch-size 8 --timeout 130 2>&1 \
      | tee "$out/multigpu-$topo.log"
    wait
    ;;
  6)
    work=$(mktemp -d)
    ( export CUDA_VISIBLE_DEVICES=0
      pin 0-15 python3 - <<'PY' 2>&1 | tee "$work/loss-ab.log"
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
      pin 0-15 timeout 60 python3 bench/bench_loss.py --device cuda --dtype bfloat16 --positions 8192 --hidden 1024 \
        --vocab 151936 --chunk 4096 --compiled 2>&1 | tee "$work/loss.log"
      pin 0-15 timeout 170 python3 bench/bench_trainer.py --target-compile off --runs cold --steps 30 --timeout 150 \
        --work-dir "$work/ref-target-off" --cache-dir "$work/cache-ref" 2>&1 | tee "$work/ref-target-off.log"
      pin 0-15 timeout 150 python3 bench/bench_trainer.py --target-compile on --runs warm --steps 30 --profile 3 \
        --timeout 130 --work-dir "$work/ref-target-on" --cache-dir "$work/cache-ref" 2>&1 | tee "$work/ref-target-on.log"
    ) &
    ( export CUDA_VISIBLE_DEVICES=1
      pin 16-31 timeout 240 python3 bench/bench_trainer.py --runs cold,warm,artifact --steps 8 --timeout 110 \
        --work-dir "$work/artifacts" 2>&1 | tee "$work/artifacts.log"
      pin 16-31 timeout 150 python3 bench/bench_trainer.py --preset small --bucket 1024 --anchors 64 --batch-size 2 \
        --drafter-layers 2 --layer-types full,sliding --runs cold,resume,resume --steps 10 --timeout 60 \
        --work-dir "$work/restart" 2>&1 | tee "$work/restart.log"
    ) &
    wait
    timeout 200 python3 bench/bench_multigpu.py --topology 1+1 --cold 1 --warm 0 --steps 30 --target-compile on \
      --timeout 150 --work-dir "$work/1+1-target-on" 2>&1 | tee "$work/1+1-target-on.log"
    timeout 120 python3 bench/bench_multigpu.py --topology 1+1 --cold 1 --warm 0 --steps 30 --target-compile off \
      --timeout 100 --work-dir "$work/1+1-target-off" 2>&1 | tee "$work/1+1-target-off.log"
    pack "$work"
    ;;
  7)
    work=$(mktemp -d)
    ( export CUDA_VISIBLE_DEVICES=0
      pin 0-15 timeout 470 python3 bench/bench_coldstart.py --cold 5 --warm 0 --steps 10 --timeout 90 \
        --work-dir "$work/safe" 2>&1 | tee "$work/coldstart.log" ) &
    ( export CUDA_VISIBLE_DEVICES=1
      # where a start's import time goes: is there bytecode for torch, can it be written?
      pin 16-31 python3 - <<'PY' > "$work/bytecode.txt" 2>&1
import importlib.util as u, os, sys
s = u.find_spec("torch"); c = u.cache_from_source(s.origin)
print("dont_write_bytecode", sys.flags.dont_write_bytecode, "prefix", sys.pycache_prefix, "torch", s.origin)
print("pyc", c, "exists", os.path.exists(c), "dir writable", os.access(os.path.dirname(s.origin), os.W_OK))
PY
      for i in 1 2; do ( time pin 16-31 python3 -c "import torch" ) 2>> "$work/bytecode.txt"; done
      pin 16-31 python3 -X importtime -c "import torch, torch._dynamo, torch._inductor.compile_fx, transformers.models.qwen3.modeling_qwen3" \
        2> "$work/importtime.txt"
      pin 16-31 timeout 260 python3 bench/bench_coldstart.py --unsafe --cold 3 --warm 0 --steps 10 --timeout 75 \
        --work-dir "$work/unsafe" 2>&1 | tee "$work/coldstart-unsafe.log"
      pin 16-31 timeout 130 python3 bench/bench_trainer.py --preset small --bucket 1024 --anchors 64 --batch-size 2 \
        --drafter-layers 2 --layer-types full,sliding --runs cold,resume,resume --steps 10 --timeout 60 \
        --work-dir "$work/restart" 2>&1 | tee "$work/restart.log"
    ) &
    wait
    pack "$work"
    ;;
  8)
    work=$(mktemp -d)
    timeout 120 python3 bench/bench_loss.py --device cuda --dtype bfloat16 --positions 8192 --hidden 1024 \
      --vocab 151936 --chunk 4096 --compiled --chunk-only 2>&1 | tee "$work/loss.log"
    grep -q '"triton_s"' "$work/loss.log" || { echo "the triton loss kernel did not run: stopping" >&2; pack "$work"; exit 1; }
    timeout 260 python3 bench/bench_trainer.py --runs cold,warm,artifact --steps 8 --timeout 120 \
      --work-dir "$work/artifacts" --cache-dir "$work/cache-ref" 2>&1 | tee "$work/artifacts.log"
    timeout 100 python3 bench/bench_trainer.py --loss-kernel triton --runs warm --steps 30 --profile 3 --timeout 90 \
      --work-dir "$work/ref-triton" --cache-dir "$work/cache-ref" 2>&1 | tee "$work/ref-triton.log"
    timeout 110 python3 bench/bench_trainer.py --loss-kernel inductor --runs warm --steps 30 --timeout 100 \
      --work-dir "$work/ref-inductor" --cache-dir "$work/cache-ref" 2>&1 | tee "$work/ref-inductor.log"
    python3 -X importtime -X pycache_prefix="$work/cache-ref/pycache" -c "import torch, torch._dynamo, \
      torch._inductor.compile_fx, torch.nn.attention.flex_attention, transformers.models.qwen3.modeling_qwen3" \
      2> "$work/importtime.txt"
    pack "$work"
    ;;
  9)
    work=$(mktemp -d)
    timeout 330 python3 bench/bench_coldstart.py --cold 5 --warm 0 --steps 6 --timeout 90 \
      --work-dir "$work/safe" 2>&1 | tee "$work/coldstart.log"
    timeout 200 python3 bench/bench_coldstart.py --unsafe --cold 2 --warm 0 --steps 6 --timeout 75 \
      --work-dir "$work/unsafe" 2>&1 | tee "$work/coldstart-unsafe.log"
    pack "$work"
    ;;
  10)
    work=$(mktemp -d)
    artifacts "$work" 330
    python3 - "$work" <<'PY' 2>&1 | tee "$work/unpack.log"
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
    timeout 150 python3 bench/bench_trainer.py --preset small --bucket 1024 --anchors 64 --batch-size 2 \
      --drafter-layers 2 --layer-types full,sliding --runs cold,resume,resume --steps 10 --timeout 60 \
      --work-dir "$work/restart" 2>&1 | tee "$work/restart.log"
    pack "$work"
    ;;
  11)
    work=$(mktemp -d)
    timeout 200 python3 bench/bench_trainer.py --target-gpus 0 --drafter-gpus 1 --runs cold --steps 30 --timeout 180 \
      --work-dir "$work/split" --cache-dir "$work/cache" 2>&1 | tee "$work/split.log"
    timeout 200 python3 bench/bench_trainer.py --target-gpus 0,1 --drafter-gpus 0,1 --runs warm --steps 30 \
      --timeout 180 --work-dir "$work/shared" --cache-dir "$work/cache" 2>&1 | tee "$work/shared.log"
    python3 - "$work" <<'PY' 2>&1 | tee "$work/advice.log"
import glob, json, os, statistics, sys
from dflashctl import contract
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
    pack "$work"
    ;;
  13)
    work=$(mktemp -d)
    artifacts "$work" 300
    timeout 120 python3 bench/bench_masks.py --device cuda --batch 2 --builders direct,eager --check-dense --attention \
      2>&1 | tee "$work/masks.log"
    for sem in causal_in_block bidirectional; do
      timeout 90 python3 bench/bench_flex.py --device cuda --variants default --window 512 --semantics $sem 2>&1 \
        | tee -a "$work/flex.log"
    done
    timeout 150 python3 bench/bench_regenerate.py --device cuda --preset qwen3-0.6b --prompts 256 --prompt-len 128 \
      --new-tokens 256 --batch-sizes 1,16,64,128 --batches 2 2>&1 | tee "$work/regenerate.log"
    pack "$work"
    ;;
  14)
    work=$(mktemp -d)
    timeout 150 python3 bench/bench_regenerate.py --device cuda --preset qwen3-0.6b --prompts 256 --prompt-len 128 \
      --new-tokens 256 --batch-sizes 1,16,64,128 --batches 2 2>&1 | tee "$work/regenerate.log"
    timeout 240 python3 bench/bench_regenerate.py --device cuda --preset tiny-cycle --e2e --steps 300 --samples 512 \
      --holdout 32 --eval-prompts 16 --block-size 16 --bucket 512 --new-tokens 256 --batch-sizes 64 2>&1 \
      | tee "$work/regenerate-e2e.log"
    soak "${2:-4}" "" "$work"
    pack "$work"
    ;;
  15)
    work=$(mktemp -d)
    timeout 150 python3 bench/bench_trainer.py --runs cold,warm --steps 30 --timeout 120 --work-dir "$work/ref" \
      2>&1 | tee "$work/ref.log"
    timeout 300 python3 bench/bench_coldstart.py --cold 5 --warm 0 --steps 6 --timeout 80 \
      --work-dir "$work/safe" 2>&1 | tee "$work/coldstart.log"
    timeout 130 python3 bench/bench_coldstart.py --unsafe --cold 2 --warm 0 --steps 6 --timeout 60 \
      --work-dir "$work/unsafe" 2>&1 | tee "$work/coldstart-unsafe.log"
    pack "$work"
    ;;
  16)
    # Logs straight into $OUT (a call cut by its time limit still returns them); OLD: another
    # checkout's bench/bench_trainer.py runs the same reference size on its own trainer.
    old=${2:-}
    w="$out/16"; mkdir -p "$w"
    timeout 120 python3 bench/bench_loss.py --device cuda --dtype bfloat16 --positions 8192 --hidden 1024 \
      --vocab 151936 --chunk 4096 --compiled --chunk-only --kernel-configs 4096x8,8192x8,8192x16,2048x4,4096x4,16384x16 \
      > "$w/loss.log" 2>&1
    timeout 150 python3 bench/bench_trainer.py --runs cold --steps 30 --profile 3 --timeout 130 \
      --work-dir /tmp/b16/ref --cache-dir /tmp/b16/cache > "$w/ref.log" 2>&1
    timeout 110 python3 bench/bench_trainer.py --flex-kernel default --runs warm --steps 30 --timeout 100 \
      --work-dir /tmp/b16/ref-default --cache-dir /tmp/b16/cache > "$w/ref-flex-default.log" 2>&1
    if [ -n "$old" ]; then
      timeout 120 python3 "$old/bench/bench_trainer.py" --runs warm --steps 30 --timeout 110 \
        --work-dir /tmp/b16/old --cache-dir /tmp/b16/cache > "$w/ref-old.log" 2>&1
    fi
    python3 -X importtime -c "import torch, torch._dynamo, torch._inductor.compile_fx, \
      torch.nn.attention.flex_attention, transformers.models.qwen3.modeling_qwen3" 2> "$w/importtime.txt"
    ;;
  17)
    w="$out/17"; mkdir -p "$w"
    timeout 100 python3 bench/bench_cuda_init.py --repeat 4 > "$w/cuda-init.log" 2>&1
    timeout 200 python3 bench/bench_trainer.py --runs cold,warm,warm,warm --steps 30 --timeout 120 \
      --work-dir /tmp/b17/ref --cache-dir /tmp/b17/cache > "$w/ref.log" 2>&1
    timeout 260 python3 bench/bench_coldstart.py --cold 5 --warm 0 --steps 6 --timeout 80 \
      --work-dir /tmp/b17/safe > "$w/coldstart.log" 2>&1
    ;;
  18)
    w="$out/18"; mkdir -p "$w"
    soak "${2:-7}" "" "$w"
    timeout 200 python3 bench/bench_coldstart.py --unsafe --cold 3 --warm 0 --steps 6 --timeout 60 \
      --work-dir /tmp/b18/unsafe > "$w/coldstart-unsafe.log" 2>&1
    ;;
  19)
    w="$out/19"; mkdir -p "$w"
    profiled b19 170 25
    timeout 100 python3 bench/bench_trainer.py --runs warm,warm --steps 12 --timeout 45 \
      --work-dir /tmp/b19/warm --cache-dir /tmp/b19/cache > "$w/warm.log" 2>&1
    PYTHONPROFILEIMPORTTIME=1 timeout 60 python3 bench/bench_trainer.py --runs warm --steps 6 --timeout 50 \
      --work-dir /tmp/b19/imp --cache-dir /tmp/b19/cache > "$w/imp-bench.log" 2>&1
    find /tmp/b19/imp -maxdepth 1 -name '*.log' -exec cp {} "$w/" \;
    ;;
  20)
    old=${2:-}
    w="$out/20"; mkdir -p "$w"
    b="python3 bench/bench_trainer.py --work-dir /tmp/b20/ref --cache-dir /tmp/b20/cache"
    profiled b20 170 25
    timeout 100 $b --runs warm,warm --steps 12 --timeout 45 > "$w/warm.log" 2>&1
    if [ -n "$old" ]; then
      timeout 100 python3 "$old/bench/bench_trainer.py" --runs warm,warm --steps 12 --timeout 45 \
        --work-dir /tmp/b20/old --cache-dir /tmp/b20/cache > "$w/warm-old.log" 2>&1
    fi
    for v in "--log-every 1" "--log-every 10" "--residual compute"; do
      timeout 100 $b --runs warm --steps 40 --timeout 90 $v >> "$w/steady.log" 2>&1
    done
    ;;
  21)
    w="$out/21"; mkdir -p "$w"
    soak "${2:-3.5}" "" "$w"
    timeout 200 python3 bench/bench_coldstart.py --cold "${3:-3}" --warm 0 --steps 6 --timeout 80 \
      --work-dir /tmp/b21/safe > "$w/coldstart.log" 2>&1
    residual_quality
    ;;
  22)
    old=${2:?part 22 needs another checkout}
    w="$out/22"; mkdir -p "$w"
    profiled b22 110 12
    alternate b22 "$old"
    soak "${3:-3}" "" "$w"
    timeout 170 python3 bench/bench_coldstart.py --cold 3 --warm 0 --steps 6 --timeout 55 \
      --work-dir /tmp/b22/safe > "$w/coldstart.log" 2>&1
    ;;
  23)
    w="$out/23"; mkdir -p "$w"
    profiled b23 150 12
    timeout 330 python3 bench/bench_trainer.py --runs warm,artifact,warm,artifact,warm,artifact --steps 30 \
      --timeout 50 --work-dir /tmp/b23/art --cache-dir /tmp/b23/cache > "$w/artifacts.log" 2>&1
    ;;
  24)
    old=${2:?part 24 needs another checkout}
    w="$out/24"; mkdir -p "$w"
    b="python3 bench/bench_trainer.py --cache-dir /tmp/b24/cache"
    timeout 110 $b --runs cold --steps 30 --timeout 100 --work-dir /tmp/b24/ref > "$w/ref.log" 2>&1
    alternate b24 "$old"
    for c in 8192 2048; do
      timeout 80 $b --runs warm --steps 40 --timeout 70 --loss-chunk $c --work-dir /tmp/b24/chunk-$c >> "$w/chunks.log" 2>&1
    done
    soak "${3:-3}" "" "$w"
    tar czf "$out/24.tgz" -C "$out" 24 $(cd "$out" && ls soak-* 2>/dev/null) && rm -rf "$w" "$out"/soak-*
    ;;
  25)
    w="$out/25"; mkdir -p "$w"
    timeout 300 python3 bench/bench_coldstart.py --cold 5 --warm 0 --steps 6 --timeout 58 \
      --work-dir /tmp/b25/safe > "$w/coldstart.log" 2>&1
    timeout 170 python3 bench/bench_coldstart.py --unsafe --cold 3 --warm 0 --steps 6 --timeout 52 \
      --work-dir /tmp/b25/unsafe > "$w/coldstart-unsafe.log" 2>&1
    tail -n 1 "$w"/*.log
    ;;
  26)
    w="$out/26"; mkdir -p "$w"
    residual_quality
    grep -h '"run"' "$w/quality.log" | cut -c1-600
    ;;
  12)
    soak "${2:-8.5}" "${3:-}" "$out"
    ;;
esac
