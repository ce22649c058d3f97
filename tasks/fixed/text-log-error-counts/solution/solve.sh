#!/usr/bin/env bash
set -e
cd /app/logs
for f in *.log; do echo "$f $(awk '$3 == "ERROR"' "$f" | wc -l)"; done > /app/error_counts.txt
