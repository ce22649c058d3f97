#!/usr/bin/env bash
# The test command (README, .ci/run): set up everything the tests need, then run them. PYTHON=... picks the
# interpreter (a virtualenv's python), as for scripts/setup.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh || exit 1
$PY -m pytest tests -q -ra -p no:cacheprovider "$@"
rc=$?
# pytest exits 5 when it collected no test: that is a broken suite here, not a pass.
if [ $rc -eq 5 ]; then echo "test.sh: pytest collected no tests" >&2; exit 1; fi
exit $rc
