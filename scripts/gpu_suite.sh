#!/usr/bin/env bash
# The GPU suite: what only a CUDA machine can tell us, in as few device calls as a lease allows.
#
#   bash scripts/gpu_suite.sh [--dry-run] [SECTION ...]
#       sections, the most valuable first (issue 86: speed beside what people would otherwise run):
#         peer peer_flux peer_qwen offload_flux offload_qwen sd15 flux qwen tests compile sdxl fp8 memory
#         profile host_memory_flux suite
#       default: peer to memory; `offload` is offload_flux and offload_qwen. A 10-minute call fits `peer` (5 min)
#       with `peer_flux`'s first pair, or one of `peer_flux`, `peer_qwen` (each builds its base: 3-4 minutes).
# A 15-minute lease (2026-12) fits one 10-minute call: `host_memory_flux peer` took 521 s on an H200 (the base's
# build 168 s, its job 106 s, the two peer sittings 221 s). A 30-minute one fits about three: `tests offload_flux`
# (590 s in 2026-11), then each whole Qwen-Image run alone (its random 20B-parameter model takes 3-4 minutes).
#
# Run from the repository root on a GPU machine (the device tool's `run`, or your own). Results go to
# $OUT (default ./gpu-out): gpu.jsonl (one scripts/bench.py line per run), one log per step, env.txt;
# host-memory.jsonl, peer.jsonl and peer-big.jsonl from those sections.
# Wheels the machine lacks may travel in .whl/ (docs/contributing/benchmarks.md): they are installed first. A device call
# carries 64 MiB, and the tracked files alone are 68 MiB since the late-2026 bases (62 of them models/): a call
# leaves the bundled bases behind but tiny-flux and tiny-qwen_image (whose tokenizers the real-width bases borrow),
# out of the index for the call and back after it:
#   git rm -r --cached -q models && git reset -q -- models/tiny-flux models/tiny-qwen_image && echo /models/ >> .git/info/exclude
#   ... the device call ...
#   git reset -q -- models && sed -i '\#^/models/$#d' .git/info/exclude
# Then 50 MiB are free: diffusers, peft, pydantic (with pydantic_core, annotated-types, typing-inspection), tomli_w,
# and for the peer datasets, dill and multiprocess came to 11 MiB in 2026-12 (torchao and bitsandbytes' CUDA 13
# library, 17 MB more, for the memory sections). The machine's own transformers (5.17) satisfies pyproject.
# --dry-run checks the suite itself on a machine without a GPU, in minutes: every step runs, each benchmark
# shrunk to its tiny model on the CPU (bench.py --dry-run), the test suite only collected, no wheels installed,
# results in ./gpu-out-dry. Its numbers mean nothing; its table says whether every step would run.
# Each step has its own time limit and a failed step does not stop the others; the last lines printed
# are a table of every step's outcome, since a device call returns only the end of the output.
set -u
PYTHON=${PYTHON:-python3}  # the interpreter with torch: the machine's own by default
DRY_RUN=()
if [ "${1:-}" = --dry-run ]; then
  DRY_RUN=(--dry-run)
  shift
fi
OUT=${OUT:-gpu-out${DRY_RUN:+-dry}}
WORKDIR=/tmp/difftune-bench${DRY_RUN:+-dry}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -n "${DRY_RUN:-}" ]; then  # this machine's own packages
  export PYTHONPATH=$PWD
elif compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "installing .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
if ! command -v difftune >/dev/null; then  # the tests' subprocesses call the command; it is not installed here
  mkdir -p /tmp/difftune-bin
  printf '#!%s\nimport sys\nfrom difftune.cli import main\nsys.exit(main())\n' "$(command -v "$PYTHON")" >/tmp/difftune-bin/difftune
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
  step "$name" "$limit" "$PYTHON" scripts/bench.py --workdir "$WORKDIR" "$@" ${DRY_RUN[@]+"${DRY_RUN[@]}"}
}

sections=()
for section in ${*:-peer peer_flux peer_qwen offload sd15 flux qwen tests compile sdxl fp8 memory}; do
  case $section in  # `offload` names both of its sections
  offload) sections+=(offload_flux offload_qwen) ;;
  *) sections+=("$section") ;;
  esac
done
for section in "${sections[@]}"; do
  case $section in
  tests)
    { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
      "$PYTHON" -c 'import torch, diffusers, transformers, peft, accelerate; print("torch", torch.__version__, "diffusers", diffusers.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "accelerate", accelerate.__version__)'
    } >"$OUT/env.txt" 2>&1
    cat "$OUT/env.txt"
    step cuda-tests 300 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py
    ;;
  sd15)  # the issue's MFU target: SD 1.5-shaped, 512 px, LoRA, bf16, batch 16, >= 35% on an H100
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
    bench flux-1024-b1-compile 500 --model flux --resolution 1024 --batch 1 --rank 16 --precision bf16 --steps 20 --warmup 5 --cache --compare compile  # regional
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
  fp8)  # FP8 compute, and fp8 frozen weights on the one-block transformers
    bench sd15-fp8 300 --model sd15 --resolution 512 --batch 16 --precision fp8 --steps 20 --warmup 5 --cache
    bench flux-1024-b1-fp8-weights 400 --model flux --resolution 1024 --batch 1 --rank 16 --precision bf16 --steps 20 --warmup 5 --cache --weight-dtype fp8
    bench qwen-1024-b1-fp8-weights 400 --model qwen_image --resolution 1024 --batch 1 --rank 16 --precision bf16 --steps 20 --warmup 5 --cache --weight-dtype fp8
    ;;
  memory)  # what fits a smaller card: quantized frozen weights, optimizer state on the CPU, the plan
    for method in int8 nf4; do
      bench "sdxl-1024-$method" 500 --model sdxl --resolution 1024 --batch 4 --rank 16 --precision bf16 --steps 10 --warmup 3 --cache --quantize "$method"
    done
    bench sd15-full-cpu-offload 400 --model sd15 --resolution 512 --batch 8 --precision bf16 --steps 10 --warmup 3 --cache --adapter none --optimizer adamw_cpu_offload
    step plan-vs-measured 580 "$PYTHON" scripts/bench_plan.py --jobs tiny-64 sd15-256 sd15-256-fp8-weights sd15-256-fp16-weights --workdir "$WORKDIR" --out "$OUT/plan.jsonl" ${DRY_RUN[@]+"${DRY_RUN[@]}"}
    bench sd15-full-adamw 400 --model sd15 --resolution 512 --batch 8 --precision bf16 --steps 10 --warmup 3 --cache --adapter none
    ;;
  offload_flux | offload_qwen) rm -rf "$WORKDIR" ;;&  # a whole model's random weights fill most of a 64 GB disk
  offload_flux)  # a whole FLUX.1 (19 double, 38 single blocks), fp8 frozen weights, checkpointed: all on the
    # device, then with blocks in host memory (target: within 12 GB at >= 0.8x the speed of all on the device)
    for offload in 0 24 40; do
      bench "flux-whole-1024-fp8-offload-$offload" 580 --model flux --blocks 19,38 --resolution 1024 --batch 1 --rank 16 --precision bf16 --steps 10 --warmup 3 --cache --weight-dtype fp8 --gradient-checkpointing --offload-blocks "$offload"
    done
    ;;
  offload_qwen)  # a whole Qwen-Image (60 blocks), likewise (target: within 16 GB)
    for offload in 0 30 45; do
      bench "qwen-whole-1024-fp8-offload-$offload" 580 --model qwen_image --blocks 60 --resolution 1024 --batch 1 --rank 16 --precision bf16 --steps 10 --warmup 3 --cache --weight-dtype fp8 --gradient-checkpointing --offload-blocks "$offload"
    done
    ;;
  host_memory_flux)  # a whole FLUX.1 [dev] at its real widths (random bf16, its published layout): each phase's
    # host and device peaks beside the plan's (scripts/bench_host_memory.py), 1024 px, fp8 weights, checkpointed;
    # not in a dry run (the base alone is 34 GB)
    if [ -z "${DRY_RUN:-}" ]; then
      rm -rf "$WORKDIR"
      mkdir -p "$WORKDIR"
      step flux-real-width-base 240 "$PYTHON" scripts/make_real_width_base.py --base black-forest-labs/FLUX.1-dev \
        --out "$WORKDIR/flux1-dev" --tokenizers-from models/tiny-flux
      step flux-1024-images 60 "$PYTHON" -c "import sys; from pathlib import Path; from difftune.toy import tiny
tiny.write_caption_folder(Path(sys.argv[1]), [(image.resize((1024, 1024)), caption)
    for image, caption in tiny.shape_images(8, seed=0)])" "$WORKDIR/data-1024"
      step flux-host-memory 400 "$PYTHON" scripts/bench_host_memory.py --out "$OUT/host-memory.jsonl" \
        --label "FLUX.1-dev at full size (random bf16), LoRA r16 on the transformer, fp8 weights, bf16, 1024 px" \
        -- --config configs/flux_lora.toml model.base="$WORKDIR/flux1-dev" data.path="$WORKDIR/data-1024" \
        data.resolution=1024 train.max_steps=10 train.batch_size=1 train.mixed_precision=bf16 model.weight_dtype=fp8 \
        adapter.text_encoder=false "sample.prompts=[]" sample.before=false train.gradient_checkpointing=true \
        train.output_dir="$WORKDIR/flux-run" optim.warmup_steps=0
    fi
    ;;
  peer)  # side by side with diffusers' LoRA example (scripts/bench_peer.py): the peer script, a copy of the harness
    # and GNU time travel in .peer/ (docs/contributing/benchmarks.md says how to fill it); not in a dry run
    if [ -z "${DRY_RUN:-}" ]; then
      for scenario in identical-sd15-512-bf16-cuda identical-sd15-512-bf16-cuda-cudnn-attention \
        recommended-sd15-512-bf16-cuda; do
        PATH=$PWD/.peer/time/usr/bin:$PATH step "peer-$scenario" 300 "$PYTHON" scripts/bench_peer.py \
          --peer-script .peer/train_text_to_image_lora.py --harness .peer/harness --results "$OUT/peer.jsonl" \
          --scenario "$scenario"
      done
    fi
    ;;
  peer_flux | peer_qwen)  # beside diffusers' DreamBooth LoRA scripts (scripts/bench_big_peer.py) on a random-weight
    # base at the real widths, built first (FLUX.1 [dev]: 168 s on an H200); the scripts travel in .peer/ beside the SD1.5
    # one. In a dry run: the tiny bases on the CPU, the peer's side where .peer/ holds its script.
    [ "$section" = peer_flux ] && scenarios=(flux-1024-bf16 flux-1024-low-memory flux-512-bf16)
    [ "$section" = peer_qwen ] && scenarios=(qwen-1024-bf16 qwen-1024-low-memory)
    [ -z "${DRY_RUN:-}" ] && rm -rf "$WORKDIR"  # the other model's random base fills the disk
    step "$section" 580 "$PYTHON" scripts/bench_big_peer.py --peer-dir .peer --workdir "$WORKDIR/big-peer" \
      --results "$OUT/peer-big.jsonl" ${scenarios[@]/#/--scenario=} ${DRY_RUN[@]+"${DRY_RUN[@]}"}
    ;;
  suite)  # the whole test suite with the GPU visible: the CPU-only assumptions it finds are bugs to fix
    if [ -n "${DRY_RUN:-}" ]; then
      step pytest-all 300 "$PYTHON" -m pytest -q -p no:cacheprovider --collect-only tests
    else
      step pytest-all 580 "$PYTHON" -m pytest -q -rf -p no:cacheprovider -n 8 --timeout 300 --junitxml "$OUT/junit.xml" tests
    fi
    ;;
  *) echo "unknown section $section"; exit 2 ;;
  esac
done
echo "== summary"
cat "$SUMMARY"
