#!/usr/bin/env bash
# Fresh machine -> .venv with the pinned CPU stack and peregrine installed (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
# test-only: z-lab's DFlash drafter (dflash/model.py), the reference of tests/test_dflash.py; its declared
# dependencies (datasets, tqdm, requests) serve its benchmark CLI, not the model, so they are left out
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps dflash==0.1.0
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
# test-only: aiperf, InferenceX's benchmark client (tests/test_aiperf.py), in its own venv: its pins conflict with
# ours (requirements-aiperf.txt says which and what is left out); --no-compile: byte-compiling all of transformers
# costs more than the few modules a run imports
[ -x .venv-aiperf/bin/python ] || python3 -m venv .venv-aiperf
.venv-aiperf/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-compile -r requirements-aiperf.txt
