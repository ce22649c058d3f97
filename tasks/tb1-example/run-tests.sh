#!/bin/bash
# Terminal-Bench 1 runs this with the tests copied to $TEST_DIR. T1 runs tests/test_*.py itself (pytest is baked
# into its images; this script would fetch it from the internet).
pip install -q pytest
pytest "$TEST_DIR/test_outputs.py" -rA
