#!/usr/bin/env bash
# The one device check: exactness on the device, peers side by side, host syncs, memory
# against the inner steps, where the step's kernel time goes and the stacked convolution's
# ways, processes sharing one device, deterministic mode's bits at 1 to 4 processes. About
# 6 minutes on one H200 (its sections, timed in separate runs, took 321 s together before
# stacked_conv gained its third way and memory its repeated steps, about 30 s more by
# estimate); the script stops it at 470 s.
#
#   benchmarks/device.sh OUT [--device cuda|cpu] [--quick] [--sections exact,syncs,...] [--tf32]
#
# float32 runs in full float32 (TF32 off) unless --tf32 is given.
#
# Results: OUT/device_check.json and OUT/device_check.md (see benchmarks/device_check.py).
# Peers (higher, torchopt) are optional rows: on a machine without a package index, carry
# them as wheels in .whl/ (pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 -d .whl higher==0.2.1 torchopt==0.7.3 optree graphviz), which this
# script installs first. `make device-check` runs it here on the CPU (--quick).
set -u
out=${1:?usage: benchmarks/device.sh OUT [--device cuda|cpu] [--quick]}
shift
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
mkdir -p "$out"
command -v nvidia-smi >/dev/null && nvidia-smi >"$out/nvidia-smi.txt" 2>&1
"$py" -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0], "cuda", torch.cuda.is_available())'
exec timeout 470 "$py" benchmarks/device_check.py "$out" "$@"
