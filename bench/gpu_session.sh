#!/usr/bin/env bash
# The GPU measurements still owed, in two parts that each fit one 10-minute device call.
# Writes logs (and nvidia-smi captures under load) into $OUT (default ./gpu-out).
#
#   bash bench/gpu_session.sh 1   # threaded cold start: 3 cold + 1 warm (1 target + 3 drafter threads, one GPU),
#                                 # then the same with the discipline off (the hang, with stacks)
#   bash bench/gpu_session.sh 2   # loss projection on GPU; reference-size tok/s, MFU, cold/warm first step
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in 1|2) ;; *) echo "usage: bash bench/gpu_session.sh 1|2" >&2; exit 2 ;; esac
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())' | tee "$out/versions.txt"

capture() {  # nvidia-smi under load, for tests/fixtures/nvidia-smi
  sleep "$1"
  nvidia-smi > "$out/h200-threads-plain.txt"
  nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw,power.limit,clocks.sm \
    --format=csv,noheader,nounits > "$out/h200-threads-query.csv"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits > "$out/h200-threads-apps.csv"
}

case "${1:-}" in
  1)
    capture 120 &
    timeout 330 python3 bench/bench_coldstart.py --cold 3 --warm 1 --steps 50 --timeout 150 2>&1 | tee "$out/coldstart.log"
    timeout 200 python3 bench/bench_coldstart.py --unsafe --cold 1 --warm 0 --steps 50 --timeout 150 2>&1 | tee "$out/coldstart-unsafe.log"
    wait
    ;;
  2)
    timeout 60 python3 bench/bench_loss.py --device cuda --dtype bfloat16 --positions 8192 --hidden 1024 --vocab 151936 2>&1 | tee "$out/loss.log"
    timeout 480 python3 bench/bench_trainer.py --steps 20 --timeout 400 2>&1 | tee "$out/trainer.log"
    ;;
esac
