#!/usr/bin/env bash
# One session on a 2x H200 machine (the device tool): installs the carried wheels
# (.whl: nixl + nixl-cu13 for Python 3.12, grpc health/reflection, protobuf), maps
# the source tree onto the tandem namespace, runs the GPU benchmarks, and leaves
# their tables in $OUT. Usage there: bash bench/gpu_session.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/ns/tandem
for m in engine prefill decode router worker common kvtransfer cli; do ln -sfn "$PWD/services/$m" "/tmp/ns/tandem/$m"; done
ln -sfn "$PWD/kernels" /tmp/ns/tandem/kernels
ln -sfn "$PWD/client/tandem/client" /tmp/ns/tandem/client
ln -sfn "$PWD/client/tandem/v1" /tmp/ns/tandem/v1
export PYTHONPATH=/tmp/site:/tmp/ns TANDEM_HOME=/tmp/tandem-home PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
date -u; nvidia-smi --query-gpu=name,memory.total --format=csv; nvidia-smi topo -m | head -4
python3 -c "import torch, grpc, google.protobuf as p, triton; print('torch', torch.__version__, 'grpc', grpc.__version__, 'protobuf', p.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
timeout 220 python3 bench/kv_transfer.py --device cuda --shape llama-3.1-8b 2>&1 | tee "$OUT/kv_transfer_progress.txt"
timeout 160 python3 bench/kv_transfer.py --device cuda --shape llama-3.1-8b --no-progress-thread --iters 10 2>&1 | tee "$OUT/kv_transfer_noprogress.txt"
timeout 180 python3 bench/disagg_e2e.py --prefill-device cuda:0 --decode-device cuda:1 --progress-thread --prompt-len 1024 2>&1 | tail -12 | tee "$OUT/disagg_e2e.txt"
