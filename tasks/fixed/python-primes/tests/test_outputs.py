import json
import subprocess


def call(expr):
    code = f"import json, sys; sys.path.insert(0, '/app'); from primes import *; print(json.dumps({expr}))"
    out = subprocess.run(["python3", "-c", code], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_module_has_both_functions():
    assert call("[callable(is_prime), callable(primes_below)]") == [True, True]


def test_small_numbers():
    assert call("[is_prime(k) for k in range(-2, 12)]") == [False] * 4 + [True, True, False, True, False, True] + [False] * 3 + [True]


def test_larger_numbers():
    assert call("[is_prime(7919), is_prime(7917), is_prime(7921)]") == [True, False, False]


def test_primes_below_30():
    assert call("primes_below(30)") == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]


def test_primes_below_edge_cases():
    assert call("[primes_below(2), primes_below(3), primes_below(0)]") == [[], [2], []]
