#!/usr/bin/env bash
set -e
cat > /app/parse_config.py <<'EOF'
import json
import sys


def parse(text):
    settings = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, value = line.split("=", 1)
        settings[key.strip()] = value.strip()
    return settings


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(parse(f.read())))
EOF
