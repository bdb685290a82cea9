#!/usr/bin/env bash
# Start one dptrain process per GPU on this host:
#   launch/run_local.sh [dptrain train options...]
# NGPUS overrides the count; PYTHON picks the interpreter (default python3).
set -euo pipefail

count_gpus() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        "${PYTHON:-python3}" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())' 2>/dev/null || echo 0
    fi
}

NGPUS="${NGPUS:-$(count_gpus)}"
if [ "${NGPUS}" -lt 1 ]; then
    echo "run_local.sh: no GPU found; for a CPU run use: mpirun -n 2 python -m dptrain --device cpu" >&2
    exit 2
fi

# Open MPI refuses to run as root unless told twice; set that only when we are root.
if [ "$(id -u)" = "0" ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# NVLink multicast (NVLS) stays off: some shared hosts are harmed by it.
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"

exec mpirun -n "${NGPUS}" --bind-to none -x NCCL_NVLS_ENABLE \
    "${PYTHON:-python3}" -m dptrain train "$@"
