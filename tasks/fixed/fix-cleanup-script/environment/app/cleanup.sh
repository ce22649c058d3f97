#!/bin/bash
# Usage: cleanup.sh DIR DAYS
dir=$1
days=$2
count=$(find $dir -mtime -$days | wc -l)
find $dir -mtime -$days -delete
echo "deleted $count"
