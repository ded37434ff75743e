# Sourced by the device scripts (`source "$(dirname "$0")/device_env.sh"`): repo root as the working
# directory, the measured commit from .commit (the device copy's git HEAD can be stale), the repo on
# PYTHONPATH (keeping what a caller added), OUT and results/, and the carried wheels (.whl, from
# scripts/fetch_gpu_wheels.sh) installed once per device call: nested scripts see PEREGRINE_WHEELS_DONE.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -f .commit ] && export PEREGRINE_COMMIT=${PEREGRINE_COMMIT:-$(cat .commit)}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# autotune results kept on disk: fla's first autotune on a fresh machine takes minutes; later processes of the
# same call reuse its choices instead of benchmarking the configs again
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
OUT=${OUT:-/tmp/peregrine-out}
mkdir -p "$OUT" results
if [ -d .whl ] && [ -z "${PEREGRINE_WHEELS_DONE:-}" ]; then  # wheels the GPU image lacks
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
  export PEREGRINE_WHEELS_DONE=1
fi
