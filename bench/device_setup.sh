#!/usr/bin/env bash
# Prepare a bare device machine (torch and triton preinstalled) to run kvpolicy from this checkout:
# the pure-Python wheels in .whl/ (carried, git-ignored) go to /tmp/site. Source it: `. bench/device_setup.sh`.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
