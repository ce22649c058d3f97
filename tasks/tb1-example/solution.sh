#!/bin/bash
awk -F, 'NR > 1 && $2 == 0 { print $1 }' /app/inventory.csv > /app/out_of_stock.txt
