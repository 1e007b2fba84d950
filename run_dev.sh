#!/bin/bash
export PYTHONPATH=$PWD
timeout 150 python3 -P -m pytest -q -p no:cacheprovider tests/sample > $OUT/tests.log 2>&1
echo "rc=$?"; tail -3 $OUT/tests.log
