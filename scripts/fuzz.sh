#!/usr/bin/env bash
# The long fuzzing run: tests/test_fuzz.py under hypothesis' `long` profile (tests/conftest.py:
# max_examples=2000 per property, random seeds), with per-test statistics. Extra arguments go to
# pytest, e.g. `scripts/fuzz.sh -k manifest`. CI runs the same file under the bounded `ci` profile.
set -euo pipefail
cd "$(dirname "$0")/.."
HYPOTHESIS_PROFILE=long exec "${PYTHON:-.venv/bin/python}" -m pytest -q tests/test_fuzz.py \
    --hypothesis-show-statistics "$@"
