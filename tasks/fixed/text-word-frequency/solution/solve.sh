#!/usr/bin/env bash
set -e
tr -cs 'A-Za-z' '\n' < /app/text.txt | tr 'A-Z' 'a-z' | grep -v '^$' | sort | uniq -c \
  | sort -k1,1nr -k2,2 | head -n 3 | awk '{print $2, $1}' > /app/top3.txt
