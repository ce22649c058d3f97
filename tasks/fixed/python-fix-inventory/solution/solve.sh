#!/usr/bin/env bash
set -e
cd /app/project
python3 - <<'EOF'
import pathlib
p = pathlib.Path("inventory.py")
s = p.read_text()
s = s.replace(
    "        have, price = self.items[name]\n        self.items[name] = (have - quantity, price)\n",
    "        have, price = self.items[name]\n"
    "        if quantity > have:\n"
    "            raise ValueError(\"not enough stock\")\n"
    "        if have == quantity:\n"
    "            del self.items[name]\n"
    "        else:\n"
    "            self.items[name] = (have - quantity, price)\n")
s = s.replace("sum(price for quantity, price in", "sum(quantity * price for quantity, price in")
p.write_text(s)
EOF
