#!/usr/bin/env bash
set -e
cd /app/repo
# A pinned date makes the revert's hash and the printed date the same in every run, so this reference
# transcript (SFT data) is too.
export GIT_AUTHOR_DATE="2024-01-02T12:00:00Z" GIT_COMMITTER_DATE="2024-01-02T12:00:00Z"
git revert --no-edit "$(git log --format=%H --grep='^Change default port$')"
