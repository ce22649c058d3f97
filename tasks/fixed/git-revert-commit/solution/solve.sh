#!/usr/bin/env bash
set -e
cd /app/repo
git revert --no-edit "$(git log --format=%H --grep='^Change default port$')"
