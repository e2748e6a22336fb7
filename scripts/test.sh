#!/usr/bin/env bash
# Set up a fresh CPU machine and run the test suite (CUDA tests skip themselves without a GPU).
# torch 2.13.0 comes first so that nothing pulls a CUDA build of torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
# Installed as a user installs it (not editable), so a module left out of the package fails here.
python -m pip install -q ".[test]"
python -m pytest tests -q "$@"
