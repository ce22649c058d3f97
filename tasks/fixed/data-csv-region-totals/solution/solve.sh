#!/usr/bin/env bash
set -e
{ echo region,total
  awk -F, 'NR > 1 { s[$2] += $4 } END { for (r in s) printf "%s,%.2f\n", r, s[r] }' /app/sales.csv | sort -t, -k2,2nr
} > /app/region_totals.csv
