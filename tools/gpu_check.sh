#!/usr/bin/env bash
# The GPU check (docs/operations.md#gpu-check): `bash tools/gpu_check.sh [OUT_DIR]`.
#
# 1. in-process: this project's profiling library on the tiny Llama on CUDA, activities
#    [cpu, cuda], steps 1 and 2 around a weight update, merged, verified, and every forward-step
#    range checked for the CUDA kernels it launched (tools/gpu_profile_check.py; no Ray, no vLLM).
# 2. vllm: the main job with the app on vLLM (config/trainer.vllm-gpu.yaml, CUDA activities),
#    steps 1 and 2 profiled through the trainer client, then `python -m profiling verify` and the
#    same kernel check over its rollout traces. Skipped where vLLM or Ray does not import.
# 3. nsys: part 2 again with the app's `profiler.tool: nsys`, under `nsys profile`. Skipped
#    where `nsys` is not on PATH.
#
# Writes OUT_DIR (default $OUT, else /tmp/gpu_check): report.txt (one PASS/FAIL/SKIP line per
# check), env.txt and one log per part; traces and models go to $GPU_CHECK_WORK (default a new
# temporary directory), a small traces.tar.gz of them to OUT_DIR. Every part is bounded by
# `timeout`; the whole run by GPU_CHECK_BUDGET_S (default 540 s).
# Exit status: 0 every check that ran passed; 1 a check failed; 3 no CUDA device, nothing checked
# (GPU_CHECK_ALLOW_CPU=1 runs the parts on CPU instead: activities [cpu], no kernel checks,
# part 2 on config/trainer.vllm.yaml).
set -u -o pipefail

OUT_DIR=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd) || exit 1
cd "$(dirname "$0")/.." || exit 1
WORK=${GPU_CHECK_WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_work.XXXXXX")}
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd)
BUDGET_S=${GPU_CHECK_BUDGET_S:-540}
PY=${PYTHON:-python3}
REPORT=$OUT_DIR/report.txt
: >"$REPORT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
export ROLLOUT_PROFILER_CACHE=${ROLLOUT_PROFILER_CACHE:-$WORK/cache}
passed=0 failed=0 skipped=0

result() { # STATUS NAME DETAIL: one report line
  echo "$1 $2: $3" | tee -a "$REPORT"
  case $1 in PASS) passed=$((passed + 1)) ;; FAIL) failed=$((failed + 1)) ;; *) skipped=$((skipped + 1)) ;; esac
}
relay() { # PREFIX LOG: the PASS/FAIL/SKIP lines a Python check printed, as report lines
  local status name detail
  while IFS= read -r line; do
    status=${line%% *}
    name=${line#* } && name=${name%%: *}
    detail=${line#*: }
    result "$status" "$1 $name" "$detail"
  done < <(grep -E '^(PASS|FAIL|SKIP) ' "$2")
}
seconds_for() { # CAP: a part's timeout, its cap or what the budget has left (less a reserve)
  local left=$((BUDGET_S - SECONDS - 20))
  if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
tail_of() { tail -n "${2:-3}" "$1" 2>/dev/null | tr '\n' ' ' | cut -c1-300; }
finish() {
  local dirs
  dirs=$(cd "$WORK" && ls -d inproc/traces vllm/traces nsys/traces 2>/dev/null)
  if [ -n "$dirs" ]; then # a few MB at most for these tiny runs; dropped when larger
    # shellcheck disable=SC2086 # one word per directory
    (cd "$WORK" && tar czf "$OUT_DIR/traces.tar.gz" --exclude='*.nsys-rep' $dirs 2>/dev/null)
    if [ "$(stat -c %s "$OUT_DIR/traces.tar.gz" 2>/dev/null || echo 0)" -gt 15000000 ]; then
      rm -f "$OUT_DIR/traces.tar.gz" && echo "traces.tar.gz over 15 MB: left in $WORK" >>"$OUT_DIR/env.txt"
    fi
  fi
  echo "$passed passed, $failed failed, $skipped skipped" | tee -a "$REPORT"
  echo "report: $REPORT; traces: $WORK"
  [ "$failed" -eq 0 ] && exit 0 || exit 1
}

torch_line=$(timeout 120 "$PY" -c 'import sys, torch
ok = torch.cuda.is_available()
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", ok)
sys.exit(0 if ok else 1)' 2>&1)
has_cuda=$?
{
  echo "date: $(date -u +%FT%TZ)  host: $(hostname)  budget: ${BUDGET_S}s"
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>&1 | head -4; else echo "nvidia-smi: absent"; fi
  echo "$torch_line" | tail -1
  echo "nsys: $(command -v nsys || echo absent)"
} >"$OUT_DIR/env.txt"
cat "$OUT_DIR/env.txt"

if [ $has_cuda -eq 0 ]; then
  DEVICE=cuda
elif [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then
  DEVICE=cpu
  echo "no CUDA device: GPU_CHECK_ALLOW_CPU=1, running the parts on CPU" | tee -a "$REPORT"
else
  echo "SKIP: no CUDA device (torch.cuda.is_available() is False); nothing checked. GPU_CHECK_ALLOW_CPU=1 runs the parts on CPU" | tee -a "$REPORT"
  exit 3
fi

# -- 1. in-process: the profiling library on the device, no Ray, no vLLM ------------------------
t=$(seconds_for 180)
timeout -k 15 "$t" "$PY" -m tools.gpu_profile_check run --out "$WORK/inproc" --device "$DEVICE" \
  >"$OUT_DIR/inproc.log" 2>&1
rc=$?
relay inproc "$OUT_DIR/inproc.log"
case $rc in
  0 | 1) ;;
  124 | 137) result FAIL inproc "no end within ${t}s (inproc.log)" ;;
  *) result FAIL inproc "exit $rc: $(tail_of "$OUT_DIR/inproc.log")" ;;
esac

# -- 2. the main job on vLLM, verified ----------------------------------------------------------
if [ "$DEVICE" = cuda ]; then
  TRAINER_CONFIG=${GPU_CHECK_TRAINER_CONFIG:-config/trainer.vllm-gpu.yaml}
else
  TRAINER_CONFIG=${GPU_CHECK_TRAINER_CONFIG:-config/trainer.vllm.yaml}
  export VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
fi
export ROLLOUT_PROFILER_CONTROL_TOKEN=${ROLLOUT_PROFILER_CONTROL_TOKEN:-$("$PY" -c 'import secrets; print(secrets.token_hex(24))')}
VLLM_OK=0
if [ "$(seconds_for 330)" -ge 150 ]; then # else parts 2 and 3 are skipped for time anyway
  why=$(timeout 180 "$PY" -c 'import vllm, ray' 2>&1) && VLLM_OK=1
  why=$(echo "$why" | tail -1 | cut -c1-200)
fi

main_job() { # NAME SAVE_DIR TIMEOUT [WRAPPER ...]: the main job (run under WRAPPER, if any), then verify
  local name=$1 dir=$2 t=$3 model rc
  shift 3
  model=$(timeout 120 "$PY" -c 'from serve_app.tiny_model import ensure_tiny_model; print(ensure_tiny_model())' 2>>"$OUT_DIR/$name.log" | tail -1)
  timeout -k 30 "$t" "$@" "$PY" -m trainer --config "$TRAINER_CONFIG" "trainer.model_path=$model" \
    "global_profiler.save_path=$dir/traces" "trainer.weights_dir=$dir/weights" \
    'global_profiler.steps=[1,2]' trainer.total_versions=3 "${EXTRA[@]}" >>"$OUT_DIR/$name.log" 2>&1
  rc=$?
  case $rc in
    0) result PASS "$name main-job" "steps 1 and 2 profiled on $TRAINER_CONFIG ($name.log)" ;;
    124 | 137) result FAIL "$name main-job" "no end within ${t}s ($name.log: $(tail_of "$OUT_DIR/$name.log" 2))" ;;
    *) result FAIL "$name main-job" "exit $rc ($name.log: $(tail_of "$OUT_DIR/$name.log"))" ;;
  esac
  timeout 150 "$PY" -m profiling verify "$dir/traces" >>"$OUT_DIR/$name.log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then
    result PASS "$name verify" "$(tail_of "$OUT_DIR/$name.log" 1)"
  else
    result FAIL "$name verify" "exit $rc ($name.log: $(tail_of "$OUT_DIR/$name.log" 4))"
  fi
}

if [ "$(seconds_for 330)" -lt 150 ]; then
  result SKIP vllm "under 150 s of the ${BUDGET_S}s budget left"
elif [ $VLLM_OK = 0 ]; then
  result SKIP vllm "vLLM or Ray does not import ($why)"
elif [ ! -f "$TRAINER_CONFIG" ]; then
  result FAIL vllm "$TRAINER_CONFIG not found"
else
  EXTRA=()
  main_job vllm "$WORK/vllm" "$(seconds_for 330)"
  if [ "$DEVICE" = cuda ]; then
    timeout 120 "$PY" -m tools.gpu_profile_check kernels "$WORK/vllm/traces" >"$OUT_DIR/vllm_kernels.log" 2>&1
    relay vllm "$OUT_DIR/vllm_kernels.log"
  else
    result SKIP "vllm cuda-kernels" "cpu mode: no CUDA activity recorded"
  fi
fi

# -- 3. tool: nsys, the app under nsys ----------------------------------------------------------
if ! command -v nsys >/dev/null; then
  result SKIP nsys "nsys is not on PATH"
elif [ "$(seconds_for 300)" -lt 150 ]; then
  result SKIP nsys "under 150 s of the ${BUDGET_S}s budget left"
elif [ $VLLM_OK = 0 ] || [ "$DEVICE" != cuda ]; then
  result SKIP nsys "needs vLLM, Ray and a CUDA device"
else
  mkdir -p "$WORK/nsys"
  serve_config=$("$PY" -c 'import sys, yaml; from trainer.config import load_config
c = yaml.safe_load(open(load_config(sys.argv[1]).rollout.serve_config))
c["applications"][0]["args"].setdefault("profiler", {})["tool"] = "nsys"
open(sys.argv[2], "w").write(yaml.safe_dump(c, sort_keys=False)); print(sys.argv[2])' \
    "$TRAINER_CONFIG" "$WORK/nsys/serve.nsys.yaml" 2>>"$OUT_DIR/nsys.log")
  EXTRA=("rollout.serve_config=$serve_config")
  main_job nsys "$WORK/nsys" "$(seconds_for 300)" \
    nsys profile --capture-range=cudaProfilerApi --capture-range-end=repeat --trace=cuda,nvtx \
    --output "$WORK/nsys/report" --force-overwrite=true
  n=$(find "$WORK/nsys" -name '*.nsys-rep' | wc -l)
  if [ "$n" -gt 0 ]; then
    result PASS "nsys reports" "$n .nsys-rep file(s) under $WORK/nsys"
  else
    result FAIL "nsys reports" "no .nsys-rep written (nsys.log)"
  fi
fi

finish
