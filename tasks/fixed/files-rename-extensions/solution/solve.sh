#!/usr/bin/env bash
set -e
find /app/photos -type f -name '*.jpeg' -exec sh -c 'mv "$1" "${1%.jpeg}.jpg"' _ {} \;
