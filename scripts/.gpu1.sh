set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
o=${OUT:-/tmp/gout}; mkdir -p $o
c=(--device cuda --size gpt2 --bf16 --fused)
timeout 120 python3 bench/overhead_breakdown.py "${c[@]}" --steps 30 --options detail_every=100000 optimizer_every=0 > $o/bd_ordinary.log 2>&1; echo "bd_ordinary rc=$?"; tail -20 $o/bd_ordinary.log
timeout 120 python3 bench/overhead_breakdown.py "${c[@]}" --steps 20 --profile 50 --options detail_every=100000 optimizer_every=0 > $o/prof.log 2>&1; echo "prof rc=$?"
timeout 120 python3 bench/overhead_breakdown.py "${c[@]}" --steps 40 --options detail_every=20 optimizer_every=20 > $o/bd_defaults.log 2>&1; echo "bd_defaults rc=$?"; tail -20 $o/bd_defaults.log
GPU_CHECK_PARTS="tests" bash scripts/gpu_checks.sh
