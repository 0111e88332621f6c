#!/usr/bin/env bash
# Regenerates the example reports in reports/ from the bundled example, with one command:
#
#     bash reports/make.sh          (needs memdoctor installed with plotly: pip install -e ".[report]")
#
#   keep_losses.memrun.json.gz        examples/keep_losses.py traced under a 96 MiB budget (it runs out)
#   keep_losses.html                  its report
#   keep_losses_fixed.memrun.json.gz  reports/keep_losses_fixed.py (the same loop keeping loss.item()), same budget
#   keep_losses_before_after.html     both runs side by side: before (the leak) and after (the fix)
set -euo pipefail
cd "$(dirname "$0")/.."
# `memdoctor trace` exits 3 when the script runs out of memory: expected for the first one.
memdoctor trace examples/keep_losses.py --budget 96MiB -o reports/keep_losses.memrun.json.gz >/dev/null || test $? -eq 3
memdoctor report reports/keep_losses.memrun.json.gz -o reports/keep_losses.html
memdoctor trace reports/keep_losses_fixed.py --budget 96MiB -o reports/keep_losses_fixed.memrun.json.gz >/dev/null
memdoctor report reports/keep_losses.memrun.json.gz reports/keep_losses_fixed.memrun.json.gz \
    -o reports/keep_losses_before_after.html
ls -l reports/*.html reports/*.memrun.json.gz
