#!/usr/bin/env bash
set -e
find /app/tree -perm -o+w | sort > /app/world_writable.txt
xargs -d '\n' chmod o-w < /app/world_writable.txt
