#!/usr/bin/env bash
set -e
cd /app/repo
git add src/app.py
git commit -q -m "Fix greeting"
