import hashlib
import json
import pathlib
import subprocess

TESTS_SHA = "964fba2248bcf84cfb961da3e5d66f97b502f0662222c3ec2451a3e8d966edb7"


def call(code):
    prog = "import json, sys; sys.path.insert(0, '/app/project'); from inventory import Inventory\n" + code
    out = subprocess.run(["python3", "-c", prog], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_project_tests_pass():
    out = subprocess.run(["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inventory.py"],
                         cwd="/app/project", capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-2000:]


def test_project_tests_unchanged():
    assert hashlib.sha256(pathlib.Path("/app/project/test_inventory.py").read_bytes()).hexdigest() == TESTS_SHA


def test_remove_partial_and_to_zero():
    code = "inv = Inventory(); inv.add('x', 5, 2.0); inv.remove('x', 3); a = inv.quantity('x'); inv.remove('x', 2)\n"
    code += "print(json.dumps([a, 'x' in inv.items]))"
    assert call(code) == [2, False]


def test_total_value_uses_quantities():
    code = "inv = Inventory(); inv.add('p', 4, 0.25); inv.add('q', 10, 3.0); print(json.dumps(inv.total_value()))"
    assert abs(call(code) - 31.0) < 1e-9


def test_failed_remove_changes_nothing():
    code = "inv = Inventory(); inv.add('g', 3, 1.0)\ntry:\n    inv.remove('g', 4)\n    r = 'no error'\n"
    code += "except ValueError:\n    r = 'ValueError'\nprint(json.dumps([r, inv.quantity('g')]))"
    assert call(code) == ["ValueError", 3]
