#!/usr/bin/env bash
# One session on a 2x H200 machine (the device tool): sets up (bench/gpu_env.sh),
# runs the GPU benchmarks, and leaves their tables in $OUT. Usage there: bash bench/gpu_session.sh
set -u
source bench/gpu_env.sh || exit 1
date -u; nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m | head -4
python3 -c "import torch, grpc, google.protobuf as p, triton; print('torch', torch.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
timeout 160 python3 bench/kv_transfer.py --device cuda --shape llama-3.1-8b --no-progress-thread 2>&1 | grep -v NIXL | tee "$OUT/kv_transfer_noprogress.txt"
timeout 160 python3 bench/kv_transfer.py --device cuda --shape llama-3.1-8b --iters 10 2>&1 | grep -v NIXL | tee "$OUT/kv_transfer_progress.txt"
timeout 180 python3 bench/disagg_e2e.py --prefill-device cuda:0 --decode-device cuda:1 --prompt-len 1024 2>&1 | tail -12 | tee "$OUT/disagg_e2e.txt"
