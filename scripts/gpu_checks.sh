#!/usr/bin/env bash
# The checks that need a CUDA device, in one run sized for a short GPU lease (the device
# tool runs it from the repository root; logs go to $OUT, or ./gpu-checks-out):
#   1. the CUDA tests (pytest -m cuda): no host sync under set_sync_debug_mode("error") on
#      the eager, compiled, guard and black-box paths; the guard's bit-exact skip; compiled
#      statistics equal eager on Inductor's GPU kernels; the one-launch NaN/Inf counts (Triton);
#   2. kernel launches gradmon adds per step (profiler), eager and compiled;
#   3. bench_overhead's ratios on a GPT-2-small-sized model in bf16 with fused AdamW:
#      defaults, the guard, and the compiled pair; then the defaults with --back-to-back.
# Each part has its own time limit, so one that hangs still leaves the others' figures.
set -u
out=${OUT:-gpu-checks-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
limit=${GPU_CHECK_LIMIT:-1}  # scale every part's time limit
parts=" ${GPU_CHECK_PARTS:-tests overhead launches overhead_b2b} "  # a short lease runs some parts only
part() {  # part NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  [[ $parts == *" $name "* ]] || return 0
  local t0=$SECONDS
  timeout $(( secs * limit )) "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-14}" "$out/$name.log"
}
nvidia-smi -L; $py -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, torch.cuda.get_device_name())'
# every file that holds a CUDA test (those marked `cuda`), found here rather than listed
mapfile -t cuda_files < <(grep -l 'mark\.cuda' tests/test_*.py)
part tests 150 $py -m pytest -q -p no:cacheprovider -m cuda -rs "${cuda_files[@]}"
common=(--device cuda --size gpt2 --bf16 --fused)
part overhead 190 $py bench/bench_overhead.py "${common[@]}" --compiled --variants unmonitored_twin gradmon_defaults --options 'guard="nonfinite"' --no-memory --rounds ${GPU_CHECK_ROUNDS:-10} --json "$out/overhead.json"
TAIL=70 part launches 200 $py bench/bench_launches.py --size gpt2 --bf16 --fused --compiled
# each copy's steps back to back, one flush per round: the fold overlaps the device's next step, as in a job
part overhead_b2b 100 $py bench/bench_overhead.py "${common[@]}" --variants unmonitored_twin gradmon_defaults --no-memory --rounds ${GPU_CHECK_ROUNDS:-10} --back-to-back --json "$out/overhead_b2b.json"
