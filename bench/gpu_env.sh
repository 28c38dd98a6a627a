#!/usr/bin/env bash
# Source on a device machine (the device tool): installs the carried wheels in .whl (`make gpu-wheels`)
# (nixl + nixl-cu13 for Python 3.12, grpc health/reflection, protobuf, pyzmq + msgspec for
# --engine-process; py-spy when added by hand: with it .whl outgrows a call's 64 MiB) and maps the
# source tree onto the tandem namespace, without pip-installing the project.
# A later call on the same warm machine need not carry the wheels again (they stay installed in
# /tmp/site).
# A call that needs none of them (the engine alone: bench/spec_decode.py) may carry none.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
elif [ ! -d /tmp/site ]; then
  echo "gpu_env.sh: no .whl carried: the cluster parts (nixl, grpc health) will not import" >&2
fi
mkdir -p /tmp/ns/tandem
for m in engine prefill decode router worker common kvtransfer cli text testing openai rl; do ln -sfn "$PWD/services/$m" "/tmp/ns/tandem/$m"; done
ln -sfn "$PWD/kernels" /tmp/ns/tandem/kernels
ln -sfn "$PWD/client/tandem/client" /tmp/ns/tandem/client
ln -sfn "$PWD/client/tandem/v1" /tmp/ns/tandem/v1
export PYTHONPATH=/tmp/site:/tmp/ns TANDEM_HOME=/tmp/tandem-home PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PATH=/tmp/site/bin:$PATH  # console scripts of the carried wheels (py-spy)
