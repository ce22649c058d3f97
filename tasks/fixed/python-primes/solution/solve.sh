#!/usr/bin/env bash
set -e
cat > /app/primes.py <<'EOF'
def is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


def primes_below(n):
    return [k for k in range(2, n) if is_prime(k)]
EOF
