#!/usr/bin/env bash
# Set up a fresh CPU machine and run the test suite (CUDA tests skip themselves without a GPU).
# torch 2.13.0 comes first, from PyTorch's CPU wheel index, so that nothing pulls the CUDA build
# (PyPI's Linux wheel): 2.13.0+cpu sorts above 2.13.0. An extra index, so a configured mirror still answers.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0 --extra-index-url https://download.pytorch.org/whl/cpu
# Installed as a user installs it (not editable), so a module left out of the package fails here.
python -m pip install -q ".[test]"
python -m ruff check . && python -m ruff format --check . && python scripts/flags_doc.py --check
python -m pytest tests -q --durations=15 "$@"
