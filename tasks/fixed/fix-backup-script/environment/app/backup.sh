#!/bin/bash
# Copy every .txt file of /app/data to /app/backups/<name>.bak
SRC=/app/data
DEST=/app/backups
for f in $(ls $SRC/*.txt); do
  cp $f $DEST/$(basename $f).bak
done
