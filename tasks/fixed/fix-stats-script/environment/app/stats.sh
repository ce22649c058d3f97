#!/bin/bash
# Usage: stats.sh FILE -> prints "MIN MAX MEAN" (MEAN with two decimals)
min=0
max=0
sum=0
count=0
while read -r x; do
  [ -z "$x" ] && continue
  if [ "$x" -lt "$min" ]; then min=$x; fi
  if [ "$x" -gt "$max" ]; then max=$x; fi
  sum=$((sum + x))
  count=$((count + 1))
done < "$1"
mean=$((sum / count))
echo "$min $max $mean"
