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
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in 1|2|3|4|5) ;; *) echo "usage: bash bench/gpu_session.sh 1|2|3|4|5" >&2; exit 2 ;; esac
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())' | tee "$out/versions.txt"

capture() {  # nvidia-smi under load, for tests/fixtures/nvidia-smi; $1: seconds to wait, $2: name
  sleep "$1"
  nvidia-smi > "$out/$2-plain.txt"
  nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw,power.limit,clocks.sm \
    --format=csv,noheader,nounits > "$out/$2-query.csv"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits > "$out/$2-apps.csv"
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
esac
