#!/usr/bin/env bash
set -e
cat > /app/svc.sh <<'EOF'
#!/bin/bash
PIDFILE=/app/worker.pid
alive() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }
case "$1" in
  start)
    alive && exit 0
    nohup setsid /app/worker.sh > /app/worker.out 2>&1 < /dev/null &
    echo $! > "$PIDFILE" ;;
  status)
    if alive; then echo running; else echo stopped; exit 3; fi ;;
  stop)
    if alive; then kill "$(cat "$PIDFILE")"; fi
    rm -f "$PIDFILE" ;;
  *) echo "usage: $0 start|status|stop" >&2; exit 2 ;;
esac
EOF
chmod +x /app/svc.sh
