#!/usr/bin/env bash
set -e
cat > /app/stats.sh <<'EOF'
#!/bin/bash
# Usage: stats.sh FILE -> prints "MIN MAX MEAN" (MEAN with two decimals)
min=
max=
sum=0
count=0
while read -r x; do
  [ -z "$x" ] && continue
  if [ -z "$min" ] || [ "$x" -lt "$min" ]; then min=$x; fi
  if [ -z "$max" ] || [ "$x" -gt "$max" ]; then max=$x; fi
  sum=$((sum + x))
  count=$((count + 1))
done < "$1"
mean=$(awk -v s="$sum" -v c="$count" 'BEGIN { printf "%.2f", s / c }')
echo "$min $max $mean"
EOF
