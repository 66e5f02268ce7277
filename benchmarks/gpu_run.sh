#!/usr/bin/env bash
# One lent GPU, one call (issue 13): calibrate it, then time every pinned plan of
# benchmarks/gpu_step_time.py on it. Device time is counted in minutes, so the whole
# session is this one script, each part under its own limit, every result written
# under OUT as soon as it exists (a part cut short loses only itself).
#
#   benchmarks/gpu_run.sh DEVICE OUT [CALIBRATE_S] [MEASURE_S] [COMPILE_S] [COMPILED_MEASURE_S] [FLOAT8_S] [CP_S]
#   DEVICE: the cost model's name of the GPU (h100-sxm, h200); plans come from
#   `python3 benchmarks/gpu_step_time.py plan --device DEVICE`, made beforehand here.
#   A part given 0 seconds is skipped: `gpu_run.sh h200 OUT 0 0 240` runs only the
#   compiled comparison (issue 31: autopar compiled / eager against hand-written eager
#   and torch.compile(model), benchmarks/compile_overhead.py --device cuda).
#   COMPILED_MEASURE_S: the pinned plans priced with compiled blocks (`autopar plan
#   --compile`, gpu_step_time_plans*_compiled.json) run compiled: predicted against
#   measured for the compiled pricing, before any other part is cut short.
#   FLOAT8_S: each case's bf16 and float8 plans (benchmarks/float8_plans_DEVICE.json,
#   made here by `python3 benchmarks/float8_gpu.py plan --device DEVICE`) trained 50 steps
#   compiled (benchmarks/float8_gpu.py measure). The GPU has no torchao: carry its wheel,
#   made here by `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
#   --implementation cp --platform manylinux_2_28_x86_64 -d .whl torchao==0.18.0`
#   (`carry: [".whl"]`); this script installs it into /tmp/site.
#   CP_S: context parallelism on CUDA (benchmarks/cp_gpu_check.py: cp 2 against one process,
#   fp32 and bf16, torch's own ring handlers for the CUDA SDPA kernels; about a minute).
set -u
dev=$1 out=$2 cal_s=${3:-200} meas_s=${4:-330} cmp_s=${5:-0} cmeas_s=${6:-0} f8_s=${7:-0} cp_s=${8:-0}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
# calibrate times a GPU's kernels on the device (Timer.kernel): check that first
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cost_measured.py -k gpu_kernel 2>&1 | tail -n 5
if [ "$cmp_s" -gt 0 ]; then
  t0=$(date +%s)
  timeout "$cmp_s" python3 benchmarks/compile_overhead.py --device cuda --out "$out/compile_overhead_${dev}" \
      --note "benchmarks/gpu_run.sh $dev OUT $cal_s $meas_s $cmp_s" 2>&1 | tail -n 20
  echo "compile comparison: $(( $(date +%s) - t0 )) s"
fi
if [ "$cp_s" -gt 0 ]; then
  t0=$(date +%s)
  timeout "$cp_s" python3 benchmarks/cp_gpu_check.py "$out" 2>&1 | tail -n 5
  echo "context parallel check: $(( $(date +%s) - t0 )) s"
fi
if [ "$f8_s" -gt 0 ]; then
  if ! python3 -c "import torchao" 2>/dev/null && ls .whl/torchao-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/torchao-*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  t0=$(date +%s)
  timeout "$f8_s" python3 benchmarks/float8_gpu.py measure --device "$dev" --out "$out/float8_gpu_${dev}_measured.json" \
      2>&1 | grep -v "Failed to load"
  echo "float8: $(( $(date +%s) - t0 )) s"
fi
if [ "$cmeas_s" -gt 0 ]; then
  t0=$(date +%s)
  timeout "$cmeas_s" python3 benchmarks/gpu_step_time.py measure --compile --device "$dev" \
      --out "$out/gpu_step_time_${dev}_compiled_measured.json"
  echo "compiled measure: $(( $(date +%s) - t0 )) s"
fi
[ "$cal_s" -gt 0 ] || exit 0
t0=$(date +%s)
timeout "$cal_s" python3 -m autopar calibrate --device cuda --ranks 1 -o "$out/${dev}_profile.json" 2>&1 | tail -n 40
echo "calibrate: $(( $(date +%s) - t0 )) s"
# held-out cases first: a measurement cut short keeps the rows nothing was set from
cases=$(python3 -c "
import json, sys; sys.path.insert(0, 'benchmarks')
import gpu_step_time as g
plans = json.load(open(g.plans_file('$dev')))
order = [*g.HELD_OUT_3, *g.HELD_OUT_2, *[c for c in g.CASES if c not in g.HELD_OUT_3 and c not in g.HELD_OUT_2]]
print(','.join(c for c in order if c in plans))")
[ "$meas_s" -gt 0 ] || exit 0
t0=$(date +%s)
timeout "$meas_s" python3 benchmarks/gpu_step_time.py measure --device "$dev" --cases "$cases" \
    --out "$out/gpu_step_time_${dev}_measured.json"
echo "measure: $(( $(date +%s) - t0 )) s"
