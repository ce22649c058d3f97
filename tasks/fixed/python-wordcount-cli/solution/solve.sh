#!/usr/bin/env bash
set -e
cat > /app/wc.py <<'EOF'
import json
import sys

args = sys.argv[1:]
as_json = "--json" in args
args = [a for a in args if a != "--json"]
try:
    with open(args[0], encoding="utf-8") as f:
        text = f.read()
except OSError as e:
    print(f"wc.py: {e}", file=sys.stderr)
    sys.exit(1)
counts = {"lines": text.count("\n"), "words": len(text.split()), "chars": len(text)}
if as_json:
    print(json.dumps(counts))
else:
    print(counts["lines"], counts["words"], counts["chars"])
EOF
