#!/bin/bash
# Run the Muon suite with this project's harness against released upstream DeepSpeed (and/or this checkout).
#   bash tools/against_upstream.sh 0.19.8                     # the whole suite against 0.19.8
#   bash tools/against_upstream.sh 0.19.6 0.19.8 this -m upstream_pr
# See tools/against_upstream.py for what it does; upstream's code stays in a temporary directory.
exec python3 "$(dirname "$0")/against_upstream.py" "$@"
