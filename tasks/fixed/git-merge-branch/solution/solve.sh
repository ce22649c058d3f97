#!/usr/bin/env bash
set -e
cd /app/repo
git merge feature || true
git checkout --theirs VERSION
git add VERSION
git commit -q --no-edit
