#!/usr/bin/env bash
set -e
cat > /app/cleanup.sh <<'EOF'
#!/bin/bash
# Usage: cleanup.sh DIR DAYS
dir=$1
days=$2
count=$(find "$dir" -type f -mtime +"$days" | wc -l)
find "$dir" -type f -mtime +"$days" -delete
echo "deleted $count"
EOF
