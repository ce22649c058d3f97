#!/usr/bin/env bash
set -e
tr 'A-Z' 'a-z' < /app/emails.txt | awk '!seen[$0]++' > /app/unique.txt
