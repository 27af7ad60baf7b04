#!/usr/bin/env bash
# Builds the Horovod baseline's venv: Python 3.11, tensorflow-cpu 2.15.1 and Horovod 0.28.1
# with Gloo only (no MPI, PyTorch or MXNet), compiled against that TensorFlow.
#
#   bash benchmarks/horovod/setup.sh            # into build/horovod-venv
#   HOROVOD_VENV=/some/where bash benchmarks/horovod/setup.sh
#
# Idempotent: a venv whose build finished (it holds .horovod-built) is left as it is; remove
# that file or the folder to rebuild. Prints how long the build took.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${HOROVOD_VENV:-$ROOT/build/horovod-venv}"
PYTHON="${PYTHON:-python3.11}"
STAMP="$VENV/.horovod-built"

if [ -f "$STAMP" ]; then
    echo "Horovod venv already built at $VENV ($(cat "$STAMP")); remove $STAMP to rebuild"
    exit 0
fi
start=$(date +%s)
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$HERE/requirements.txt"
# --no-cache-dir: a cached Horovod wheel may have been compiled against another TensorFlow.
HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_PYTORCH=1 \
HOROVOD_WITHOUT_MXNET=1 \
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir \
    --no-build-isolation horovod==0.28.1
TF_CPP_MIN_LOG_LEVEL=2 "$VENV/bin/python" -c "import horovod.tensorflow as hvd; assert hvd.gloo_built(), 'Horovod built without Gloo'"
seconds=$(( $(date +%s) - start ))
echo "built in ${seconds} s on $(date -u +%Y-%m-%d)" > "$STAMP"
echo "Horovod venv built at $VENV in ${seconds} s (horovodrun: $VENV/bin/horovodrun)"
