#!/usr/bin/env bash
set -e
cd /app/repo
git log --format=%H -S API_KEY --reverse | head -n 1 > /app/answer.txt
