#!/usr/bin/env bash
# Issue 7's session on an H200 machine (the device tool), one GPU or more: the GPU engine tests,
# bench/serve.py's table, kernel timings, and KV pulls (raw, and under GIL contention). Each part
# has its own time limit so a failure costs only its part; outputs land in $OUT.
# Usage there: [PARTS="tests fidelity lora gemv serve kernels pull pull1 split1"] bash bench/gpu_engine_session.sh [serve.py args...]
# pull1: KV pulls between two processes on cuda:0, tandem's default beside UCX's (issue 41);
# split1: the split served from one GPU beside the aggregated worker (bench/split_one_gpu.py).
# wsync: update_weights by CUDA IPC handles against the checkpoint path (bench/weight_sync.py).
# fp8: the served rows in bf16, with FP8 weights, and with FP8 weights + FP8 KV (bench/serve.py --engine-extra; FP8_ONLY="names": of bf16, fp8w, fp8wkv).
# fp8check: bench/fp8_check.py (FP8 weights and KV on the device against the CPU reference).
# det: --deterministic against the default mode, and batch invariance (bench/deterministic.py).
# multiturn: the host KV tier's multi-turn TTFT (bench/multiturn.py), sessions outgrowing the pool.
# proc: the served rows with the engine core in its own process (--engine-process) beside the
#   default, and bench/engine_process.py's served step against in-process (issue 28).
# spec: speculative decoding (ngram, suffix) against plain decoding, SmolLM2 (bench/spec_decode.py).
# smol: SmolLM2's GGUF (the real chat model the spec rows need), carried in pieces over calls on one
#   warm machine: a call that carries .smol/partNN keeps it in /tmp/smol; once every piece of
#   .smol/sha's file is there, they are joined and checked (`split -b 50000000 -d FILE .smol/part`).
# e2e: the handover taken apart on one GPU, prefill and decode two processes on cuda:0 (bench/disagg_e2e.py).
# procstep: bench/engine_process.py alone (the served step against in-process over the same contexts).
# stephost: the engine's host work per step (bench/step_host.py), block tables written whole and as new entries.
# enghandover: a step's outputs and a command's reply to the worker's loop and its tasks, the engine thread's
# wait in its variants (bench/engine_handover.py).
# moe: the fused MoE kernel against its torch reference at Qwen3-30B-A3B's layer shape, and a served
# Qwen3-MoE-shaped engine cut to MOE_LAYERS layers (bench/moe.py).
set -u
source bench/gpu_env.sh || exit 1
PARTS=${PARTS:-tests fidelity lora serve kernels pull}
{
  date -u; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
  df -h /dev/shm /tmp | tail -2; nproc; free -g | head -2
} 2>&1 | tee "$OUT/session.txt"
has() { [[ " $PARTS " == *" $1 "* ]]; }
CKPT=/dev/shm/tandem-llama-3.1-8b-bf16
ckpt() {  # the 8B-shaped random checkpoint bench/serve.py writes (kept between parts)
  python3 -c "import sys, torch; from pathlib import Path; sys.path.insert(0, 'bench'); from serve import SHAPES, write_checkpoint; write_checkpoint(Path('$CKPT'), SHAPES['llama-3.1-8b'], torch.device('cuda:0'))"
}
if has tests; then
  timeout "${PYTEST_S:-130}" python3 -m pytest -v -rfE --tb=short -p no:cacheprovider ${PYTEST_FILES:-tests/test_gpu_engine.py tests/test_lora_gpu.py \
    $(ls tests/test_tensor_parallel_gpu.py 2>/dev/null)} 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -25
fi
if has fidelity; then  # issue 9's server features on the GPU against the CPU
  timeout "${FIDELITY_S:-120}" python3 bench/gpu_fidelity_check.py 2>&1 | grep -v NIXL | tee "$OUT/fidelity.txt" | tail -20
fi
if has lora; then
  timeout "${LORA_S:-150}" python3 bench/lora.py 2>&1 | grep -v "NIXL\|Loading weights" | tee "$OUT/lora.txt" | tail -15
fi
if has gemv; then  # batch-1 GEMMs: the Triton GEMV against cuBLAS, alone and in the engine
  timeout "${GEMV_S:-240}" python3 bench/gemv.py ${GEMV_ARGS:-} 2>&1 | grep -v "NIXL\|Loading weights" | tee "$OUT/gemv.txt" | tail -30
fi
if has serve; then
  timeout "${SERVE_S:-330}" python3 bench/serve.py "$@" 2>&1 | grep -v "NIXL\|Loading weights" | tee "$OUT/serve.txt" | tail -45
fi
if has kernels; then
  timeout "${KERNELS_S:-70}" python3 bench/kernels.py --sweep-prefill 2>&1 | tee "$OUT/kernels.txt" | tail -40
fi
if has pull; then
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    timeout "${TRANSFER_S:-60}" python3 bench/kv_transfer.py --device cuda --shape llama-3.1-8b --no-progress-thread --iters 10 2>&1 | grep -v NIXL | tee "$OUT/kv-transfer.txt"
  fi
  (cd bench && timeout "${PULL_S:-45}" python3 kv_pull_contention.py --device cuda --shape llama-3.1-8b --iters 10) 2>&1 | grep -v NIXL | tee "$OUT/kv-pull.txt"
fi
if has pull1; then  # one GPU: the transceiver's default (CUDA IPC get path on) beside UCX's own choice
  for ipc in default auto; do
    # UCX's own choice moves ~0.4 GB/s here: fewer samples, or the 8192-token row alone takes 30 s.
    env_flag=$([ "$ipc" = auto ] && echo "--ucx-cuda-ipc-get auto")
    iters=$([ "$ipc" = auto ] && echo "--iters 3 --warmup 1" || echo "--iters 10")
    timeout "${PULL1_S:-60}" python3 bench/kv_transfer.py --device cuda --pair one-gpu --shape llama-3.1-8b \
      --no-progress-thread $iters $env_flag 2>&1 | grep -v "NIXL INFO" | tee "$OUT/kv-transfer-1gpu-$ipc.txt"
    (cd bench && timeout "${PULL1_S:-60}" python3 kv_pull_contention.py --device cuda --shape llama-3.1-8b \
      --iters $([ "$ipc" = auto ] && echo 4 || echo 10) $env_flag) 2>&1 | grep -v "NIXL INFO" | tee "$OUT/kv-pull-1gpu-$ipc.txt"
  done
fi
if has wsync; then  # update_weights by CUDA IPC handles (issue 32): one GPU, trainer and worker on it
  ckpt && timeout "${WSYNC_S:-420}" python3 bench/weight_sync.py --device cuda --model "$CKPT" \
    --paths "${WSYNC_PATHS:-ipc,checkpoint}" --repeats "${WSYNC_REPEATS:-2}" 2>&1 \
    | grep -v "NIXL\|Loading weights\|Writing model" | tee "$OUT/weight-sync.txt" | tail -8
fi
if has split1; then
  timeout "${SPLIT1_S:-420}" python3 bench/split_one_gpu.py ${SPLIT1_ARGS:-} 2>&1 | grep -v "NIXL\|Loading weights" \
    | tee "$OUT/split-one-gpu.txt" | tail -25
fi
SMOL=/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
if has smol; then
  mkdir -p /tmp/smol && cp .smol/* /tmp/smol/ 2>/dev/null
  ls .smol/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/site .smol/*.whl  # gguf, to convert it
  if [ ! -f "$SMOL" ] && [ -f /tmp/smol/sha ] && [ -f /tmp/smol/part00 ] && [ -f /tmp/smol/part01 ]; then
    cat /tmp/smol/part0* > "$SMOL" && (cd /tmp/smol && sed "s|  .*|  $SMOL|" sha | sha256sum -c) || rm -f "$SMOL"
  fi
  ls -la /tmp/smol
fi
if has e2e; then  # issue 39: prefill and decode on one GPU, two processes
  ckpt && timeout "${E2E_S:-300}" python3 bench/disagg_e2e.py --prefill-device cuda:0 --decode-device cuda:0 \
    --model "$CKPT" ${E2E_ARGS:---prompt-len 1024 --num-requests 16} 2>&1 | grep -v "NIXL\|Loading weights" | tee "$OUT/disagg-e2e-1gpu.txt" | tail -30
fi
if has spec; then  # issue 31: needs a real chat model there (SPEC_ARGS="--model DIR"): a random checkpoint loops
  timeout "${SPEC_S:-300}" python3 bench/spec_decode.py --device cuda --max-tokens "${SPEC_TOKENS:-256}" \
    --batch "${SPEC_BATCH:-32}" ${SPEC_ARGS:---model $SMOL} 2>&1 | grep -v "NIXL\|Loading weights" | tee "$OUT/spec-decode.txt" | tail -16
fi
if has fp8check; then  # issue 30: the device's FP8 tokens against the CPU reference
  timeout "${FP8CHECK_S:-150}" python3 bench/fp8_check.py 2>&1 | grep -v "NIXL\|Loading weights" | tee "$OUT/fp8-check.txt" | tail -20
fi
if has fp8; then  # issue 30: the same rows per precision, one cluster each
  for variant in "bf16:" "fp8w:--quantization fp8" "fp8wkv:--quantization fp8 --kv-cache-dtype fp8"; do
    name=${variant%%:*}; flags=${variant#*:}
    if [ -n "${FP8_ONLY:-}" ] && [[ " $FP8_ONLY " != *" $name "* ]]; then continue; fi
    mkdir -p "$OUT/serve-$name"
    timeout "${FP8_S:-170}" python3 bench/serve.py --phases serve --rows "${FP8_ROWS:-bs1,c64,offline,ttft}" \
      --engine-extra="$flags" --out "$OUT/serve-$name" 2>&1 | grep -v "NIXL\|Loading weights" \
      | tee "$OUT/serve-$name.txt" | tail -12
  done
fi
if has det; then  # issue 33: the deterministic mode's cost and its batch invariance on the GPU
  # DET_TILES="128 256": the same rows again per GEMM row tile (bench/deterministic.py --gpu-row-tile).
  for tile in ${DET_TILES:-default}; do
    tile_flag=$([ "$tile" = default ] || echo "--gpu-row-tile $tile")
    ckpt && timeout "${DET_S:-240}" python3 bench/deterministic.py --device cuda --model "$CKPT" \
      --repeats "${DET_REPEATS:-2}" --alone "${DET_ALONE:-8}" $tile_flag 2>&1 | grep -v "NIXL\|Loading weights" \
      | tee "$OUT/deterministic-$tile.txt" | tail -10
  done
fi
if has multiturn; then  # issue 36: 32 sessions of ~0.5-1k tokens against a 4,096-token device pool
  ckpt && timeout "${MULTITURN_S:-240}" python3 bench/multiturn.py --device cuda --model "$CKPT" \
    ${MULTITURN_ARGS:---sessions 32 --turns 4 --first-prompt 512 --question 64 --answer 32 --pool-blocks 256 \
    --host-gb 8} 2>&1 | grep -v "NIXL\|Loading weights" | tee "$OUT/multiturn.txt" | tail -14
fi
if has proc; then  # issue 28: the engine core process against the engine thread, same run
  for variant in "thread:" "process:--engine-process"; do
    name=${variant%%:*}; flags=${variant#*:}
    mkdir -p "$OUT/serve-$name"
    timeout "${PROC_S:-170}" python3 bench/serve.py --phases serve --rows "${PROC_ROWS:-bs1,c64,offline}" \
      --engine-extra="$flags" --out "$OUT/serve-$name" 2>&1 | grep -v "NIXL\|Loading weights" \
      | tee "$OUT/serve-$name.txt" | tail -12
  done
  ckpt && timeout "${PROCSTEP_S:-200}" python3 bench/engine_process.py --device cuda --model "$CKPT" \
    --streams 64,256 --repeats 1 --window 5 --num-blocks 16384 2>&1 | grep -v "NIXL\|Loading weights" \
    | tee "$OUT/engine-process.txt" | tail -6
fi
if has procstep; then  # issue 28: bench/engine_process.py alone (proc without the served rows)
  ckpt && timeout "${PROCSTEP_S:-200}" python3 bench/engine_process.py --device cuda --model "$CKPT" \
    --streams "${PROCSTEP_STREAMS:-64,256}" --repeats 1 --window 5 --num-blocks 16384 2>&1 | grep -v "NIXL\|Loading weights" \
    | tee "$OUT/engine-process.txt" | tail -6
fi
if has stephost; then  # issue 28: the engine's host work per step, the device's block table written whole vs new entries
  ckpt && timeout "${STEPHOST_S:-200}" python3 bench/step_host.py --device cuda --model "$CKPT" \
    --batches "${STEPHOST_BATCHES:-64,256}" --prompt-len "${STEPHOST_PROMPT:-512}" --num-blocks 16384 --steps 30 --top 12 --tables both \
    2>&1 | grep -v "NIXL\|Loading weights" | tee "$OUT/step-host.txt" | tail -60
fi
if has enghandover; then  # issue 39: the engine thread's wait for the loop, on and off in turns
  ckpt && timeout "${ENGHANDOVER_S:-400}" python3 bench/engine_handover.py --device cuda --model "$CKPT" \
    --streams "${ENGHANDOVER_STREAMS:-1,16,64}" --prompt-len 512 --max-tokens 64 --repeats 3 --num-blocks 16384 --call-every-ms 2 \
    2>&1 | grep -v "NIXL\|Loading weights" | tee "$OUT/engine-handover.txt" | tail -10
fi
if has moe; then  # issue 29: grouped-GEMM MoE kernel vs torch, per token count, and a served row
  timeout "${MOE_S:-300}" python3 bench/moe.py --device cuda --served-layers "${MOE_LAYERS:-4}" 2>&1 \
    | grep -v "NIXL\|Loading weights" | tee "$OUT/moe.txt" | tail -20
fi
