#!/usr/bin/env bash
# Every CPU benchmark once, at its --quick default; output to $BENCH_OUT/<tag>/ (default /tmp/qwen3_bench).
# Usage: benchmarks/run_all.sh [tag]
set -u
cd "$(dirname "$0")/.."
. .venv/bin/activate 2>/dev/null || true
tag=${1:-$(date +%H%M%S)}
out=${BENCH_OUT:-/tmp/qwen3_bench}/$tag
mkdir -p "$out"
start=$(date +%s)
for b in overhead vs_torchtitan backends mfu memory scaling startup; do
  t0=$(date +%s)
  echo "== bench_$b (load $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$out/all.log"
  python benchmarks/bench_$b.py > "$out/$b.txt" 2> "$out/$b.err"; rc=$?
  echo "   rc=$rc $(( $(date +%s) - t0 )) s" | tee -a "$out/all.log"
done
echo "total $(( $(date +%s) - start )) s" | tee -a "$out/all.log"
