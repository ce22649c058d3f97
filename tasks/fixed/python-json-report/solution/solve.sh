#!/usr/bin/env bash
set -e
cat > /app/report.py <<'EOF'
import json

with open("/app/orders.json") as f:
    orders = json.load(f)
totals = {}
for order in orders:
    spent = sum(item["qty"] * item["price"] for item in order["items"])
    totals[order["customer"]] = totals.get(order["customer"], 0) + spent
with open("/app/report.json", "w") as f:
    json.dump({c: round(t, 2) for c, t in totals.items()}, f, indent=2)
EOF
python3 /app/report.py
