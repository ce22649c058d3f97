#!/usr/bin/env bash
set -e
cat > /app/backup.sh <<'EOF'
#!/bin/bash
# Copy every .txt file of /app/data to /app/backups/<name>.bak
SRC=/app/data
DEST=/app/backups
mkdir -p "$DEST"
for f in "$SRC"/*.txt; do
  [ -e "$f" ] || continue
  cp "$f" "$DEST/$(basename "$f").bak"
done
EOF
chmod +x /app/backup.sh
