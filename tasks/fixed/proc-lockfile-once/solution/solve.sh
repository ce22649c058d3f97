#!/usr/bin/env bash
set -e
cat > /app/once.sh <<'EOF'
#!/bin/bash
exec 9> /app/once.lock
flock -n 9 || exit 75
"$@" 9>&-
EOF
chmod +x /app/once.sh
