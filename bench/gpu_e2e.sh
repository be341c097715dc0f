#!/usr/bin/env bash
# dflashctl itself on a GPU machine, on its local host: launch a qwen3-0.6b-shaped
# run (bench/gpu/gpu-e2e.yaml) supervised in the foreground, SIGKILL its trainer
# once it trains (the supervisor classifies the crash and restarts it from its
# checkpoint), let it finish, evaluate it, and keep what the operator would see.
# Needs dflashctl's pure-Python dependencies importable (PYTHONPATH) and tmux.
# Writes into $OUT: launch.log, events.txt, runs.txt, status.txt, nvidia-smi captures.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 DFLASHCTL_HOME=$(mktemp -d) PYTHONPATH="$PWD:${PYTHONPATH:-}"
ngpu=$(nvidia-smi -L | wc -l)
pb=bench/gpu/gpu-e2e.yaml
if [ "$ngpu" -lt 2 ]; then sed 's/drafter: \[1\]/drafter: [0]/' $pb > /tmp/gpu-e2e.yaml; pb=/tmp/gpu-e2e.yaml; fi
python3 -m dflashctl check local > "$out/check.txt" 2>&1
python3 -m dflashctl launch "$pb" --foreground > "$out/launch.log" 2>&1 &
launcher=$!
run_dir() { ls -d "$DFLASHCTL_HOME"/work/runs/gpu-e2e-* 2>/dev/null | head -1; }
until [ -n "$(run_dir)" ] && [ "$( (wc -l < "$(run_dir)/metrics.jsonl") 2>/dev/null || echo 0)" -ge 6 ]; do
  sleep 2; kill -0 $launcher 2>/dev/null || break
done
nvidia-smi > "$out/h200x$ngpu-train-plain.txt"
nvidia-smi --query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw,power.limit,clocks.sm \
  --format=csv,noheader,nounits > "$out/h200x$ngpu-train-query.csv"
pid=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['pid'])" "$(run_dir)/status.json")
echo "$(date +%s.%N) SIGKILL trainer $pid" >> "$out/launch.log"
kill -9 "$pid"
wait $launcher; echo "launch exit $?" >> "$out/launch.log"
run=$(basename "$(run_dir)")
python3 -m dflashctl events "$run" > "$out/events.txt" 2>&1
python3 -m dflashctl runs > "$out/runs.txt" 2>&1
COLUMNS=120 python3 -m dflashctl status --once > "$out/status.txt" 2>&1
python3 -m dflashctl runs --json > "$out/runs.json" 2>&1
tail -40 "$(run_dir)/trainer.log" > "$out/trainer-tail.txt"
