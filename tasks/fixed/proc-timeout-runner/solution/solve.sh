#!/usr/bin/env bash
set -e
cat > /app/runjobs.sh <<'EOF'
#!/bin/bash
for f in /app/jobs/*; do
  [ -f "$f" ] && [ -x "$f" ] || continue
  timeout -k 1 2 "$f" > /dev/null 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then s=ok; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then s=timeout; else s=failed; fi
  echo "$(basename "$f") $s" >> /app/results.txt
done
EOF
chmod +x /app/runjobs.sh
