#!/usr/bin/env bash
set -e
sqlite3 -separator , /app/shop.db "SELECT c.name, printf('%.2f', SUM(o.amount)) AS t FROM orders o
  JOIN customers c ON c.id = o.customer_id GROUP BY c.id ORDER BY SUM(o.amount) DESC LIMIT 3" > /app/top_customers.txt
