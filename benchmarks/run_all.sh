#!/usr/bin/env bash
# Every CPU benchmark once, in one pass on one machine, at its default settings; each script's raw
# output goes to $BENCH_OUT/<name>.txt (default benchmarks/results/, committed beside RESULTS.md),
# its stderr to <name>.err, and the machine it ran on to machine.txt (CPU model and the flags that
# decide the figures: AVX2 / AVX-512 / AVX512-BF16 / AMX, cores, memory, torch and thread count).
# Usage: benchmarks/run_all.sh [name ...]   (default: all of them, in the order below)
# Run it alone on the machine: the figures are ratios measured side by side, but the absolute times
# (and bench_scaling's exponents) move with any other load; all.log records the load average.
set -u
cd "$(dirname "$0")/.."
. .venv/bin/activate 2>/dev/null || true
out=${BENCH_OUT:-benchmarks/results}
mkdir -p "$out"
all=(default_run overhead vs_torchtitan backends mfu memory scaling startup moe_experts chunked_loss plan moe_routing moe_balance chat_packing bf16_lm_head async_checkpoint)
names=("${@:-${all[@]}}")
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
  echo "cores: $(nproc) (os.cpu_count), memory: $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo)"
  flags=$(grep -m1 '^flags' /proc/cpuinfo)
  for f in avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile; do
    if [[ " $flags " == *" $f "* ]]; then echo "flag $f: yes"; else echo "flag $f: no"; fi
  done
  python -c "import torch; print('torch', torch.__version__, '| threads', torch.get_num_threads(), '| mkldnn bf16 supported', torch.ops.mkldnn._is_mkldnn_bf16_supported())"
  echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
} > "$out/machine.txt"
cat "$out/machine.txt"
start=$(date +%s)
: > "$out/all.log"
for b in "${names[@]}"; do
  t0=$(date +%s)
  echo "== bench_$b (load $(cut -d' ' -f1-3 /proc/loadavg))" | tee -a "$out/all.log"
  python "benchmarks/bench_$b.py" > "$out/$b.txt" 2> "$out/$b.err"; rc=$?
  echo "   rc=$rc $(( $(date +%s) - t0 )) s" | tee -a "$out/all.log"
  [ -s "$out/$b.err" ] || rm -f "$out/$b.err"
done
echo "total $(( $(date +%s) - start )) s; load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/all.log"
