#!/usr/bin/env bash
# The GPU suite: what only a CUDA machine can tell us, in as few device calls as a lease allows.
#
#   bash scripts/gpu_suite.sh [SECTION ...]     sections: tests sd15 profile compile sdxl flux qwen memory offload suite
#                                               (default: all but profile)
#
# Run from the repository root on a GPU machine (the device tool's `run`, or your own). Results go to
# $OUT (default ./gpu-out): gpu.jsonl (one scripts/bench.py line per run), one log per step, env.txt.
# Wheels the machine lacks may travel in .whl/ (see BENCHMARKS.md, "GPU"): they are installed first.
# Each step has its own time limit and a failed step does not stop the others; the last lines printed
# are a table of every step's outcome, since a device call returns only the end of the output.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
if ! command -v difftune >/dev/null; then  # the tests' subprocesses call the command; it is not installed here
  mkdir -p /tmp/difftune-bin
  printf '#!/usr/bin/env python3\nimport sys\nfrom difftune.cli import main\nsys.exit(main())\n' >/tmp/difftune-bin/difftune
  chmod +x /tmp/difftune-bin/difftune
  export PATH=/tmp/difftune-bin:$PATH
fi
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

step() {  # step NAME LIMIT_SECONDS COMMAND...: stdout's JSON lines to gpu.jsonl, everything to NAME.log
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  echo "== $name: $*"
  timeout "$limit" "$@" > >(tee -a "$OUT/$name.log" | grep '^{' >>"$OUT/gpu.jsonl") 2>>"$OUT/$name.log"
  rc=$?
  printf '%-28s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$SUMMARY"
  [ "$rc" = 0 ] || tail -n 5 "$OUT/$name.log"
}

bench() {  # bench NAME LIMIT [bench.py arguments]
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" python3 scripts/bench.py --workdir /tmp/difftune-bench "$@"
}

sections=${*:-tests sd15 compile sdxl flux qwen memory offload suite}
for section in $sections; do
  case $section in
  tests)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      python3 -c 'import torch, diffusers, transformers, peft, accelerate; print("torch", torch.__version__, "diffusers", diffusers.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "accelerate", accelerate.__version__)'
    } >"$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
    step cuda-tests 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
    ;;
  sd15)  # the MFU target: SD 1.5-shaped, 512 px, LoRA, bf16, batch 16, >= 35% on an H100
    for batch in 1 8 16; do
      bench "sd15-b$batch" 300 --model sd15 --resolution 512 --batch "$batch" --precision bf16 --steps 20 --warmup 5 --cache
    done
    bench sd15-channels_last 400 --model sd15 --resolution 512 --batch 16 --precision bf16 --steps 20 --warmup 5 --cache --compare channels_last
    ;;
  profile)  # where a step's time goes: torch.profiler's tables, host and device (bench.py --profile)
    bench sd15-b16-unprofiled 300 --model sd15 --resolution 512 --batch 16 --precision bf16 --steps 20 --warmup 5 --cache
    bench sd15-b16-profile 300 --model sd15 --resolution 512 --batch 16 --precision bf16 --steps 20 --warmup 5 --cache --profile "$OUT/profile-sd15-b16.txt"
    ;;
  compile)  # train.compile against eager, after tests/test_cuda.py checked that it trains the same
    bench sd15-compile 500 --model sd15 --resolution 512 --batch 16 --precision bf16 --steps 20 --warmup 5 --cache --compare compile
    ;;
  sdxl)
    bench sdxl-1024-b4 500 --model sdxl --resolution 1024 --batch 4 --rank 16 --precision bf16 --steps 20 --warmup 5 --cache
    ;;
  flux)  # FLUX.1's widths in 1 double- and 2 single-stream blocks of its 19 and 38
    bench flux-1024-b1 400 --model flux --resolution 1024 --batch 1 --rank 16 --precision bf16 --steps 20 --warmup 5 --cache
    ;;
  qwen)  # Qwen-Image's widths in 1 of its 60 blocks
    bench qwen-1024-b1 400 --model qwen_image --resolution 1024 --batch 1 --rank 16 --precision bf16 --steps 20 --warmup 5 --cache
    ;;
  memory)  # what fits a smaller card: FP8 compute, fp8 frozen weights, quantized ones, optimizer state on the CPU
    bench sd15-fp8 300 --model sd15 --resolution 512 --batch 16 --precision fp8 --steps 20 --warmup 5 --cache
    bench flux-1024-b1-fp8-weights 400 --model flux --resolution 1024 --batch 1 --rank 16 --precision bf16 --steps 20 --warmup 5 --cache --weight-dtype fp8
    bench qwen-1024-b1-fp8-weights 400 --model qwen_image --resolution 1024 --batch 1 --rank 16 --precision bf16 --steps 20 --warmup 5 --cache --weight-dtype fp8
    for method in int8 nf4; do
      bench "sdxl-1024-$method" 500 --model sdxl --resolution 1024 --batch 4 --rank 16 --precision bf16 --steps 10 --warmup 3 --cache --quantize "$method"
    done
    bench sd15-full-cpu-offload 400 --model sd15 --resolution 512 --batch 8 --precision bf16 --steps 10 --warmup 3 --cache --adapter none --optimizer adamw_cpu_offload
    step plan-vs-measured 580 python3 scripts/bench_plan.py --workdir /tmp/difftune-bench --out "$OUT/plan.jsonl"
    bench sd15-full-adamw 400 --model sd15 --resolution 512 --batch 8 --precision bf16 --steps 10 --warmup 3 --cache --adapter none
    ;;
  offload)  # whole FLUX.1 (19 double, 38 single blocks) and Qwen-Image (60) transformers, fp8 frozen weights,
    # checkpointed: all on the device, then with blocks in host memory (targets: FLUX.1 within 12 GB at >= 0.8x
    # the speed of all on the device, Qwen-Image within 16 GB)
    for offload in 0 24 40; do
      bench "flux-whole-1024-fp8-offload-$offload" 580 --model flux --blocks 19,38 --resolution 1024 --batch 1 --rank 16 --precision bf16 --steps 10 --warmup 3 --cache --weight-dtype fp8 --gradient-checkpointing --offload-blocks "$offload"
    done
    for offload in 0 30 45; do
      bench "qwen-whole-1024-fp8-offload-$offload" 580 --model qwen_image --blocks 60 --resolution 1024 --batch 1 --rank 16 --precision bf16 --steps 10 --warmup 3 --cache --weight-dtype fp8 --gradient-checkpointing --offload-blocks "$offload"
    done
    ;;
  suite)  # the whole test suite with the GPU visible: the CPU-only assumptions it finds are bugs to fix
    step pytest-all 580 python3 -m pytest -q -rf -p no:cacheprovider -n 8 --timeout 300 --junitxml "$OUT/junit.xml" tests
    ;;
  *) echo "unknown section $section"; exit 2 ;;
  esac
done
echo "== summary"
cat "$SUMMARY"
