#!/bin/bash
# Call 1 of h200-2026-12-03d on the H200 (carry .carry/whl): the previous session's next call,
# run as it was written: the fused group codes as committed (pointers built as a tile, wide
# stores), first on a GPU.
bash docs/results/h200-2026-12-03c/next/ab.sh
