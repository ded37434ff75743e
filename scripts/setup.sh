#!/usr/bin/env bash
# Fresh machine -> .venv with the pinned CPU stack and peregrine installed (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements-cpu.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
