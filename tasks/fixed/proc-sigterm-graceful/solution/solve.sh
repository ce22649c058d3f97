#!/usr/bin/env bash
set -e
cat > /app/graceful.sh <<'EOF'
#!/bin/bash
trap 'echo "shutdown complete" > /app/shutdown.log; exit 0' TERM
while true; do
  echo tick >> /app/ticks.log
  sleep 0.5 &
  wait $!
done
EOF
chmod +x /app/graceful.sh
