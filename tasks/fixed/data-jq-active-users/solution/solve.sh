#!/usr/bin/env bash
set -e
jq -r '.[] | select(.active and .age >= 30) | .name' /app/users.json | sort > /app/active.txt
