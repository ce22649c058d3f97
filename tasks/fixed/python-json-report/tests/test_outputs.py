import json
import pathlib
import subprocess

REPORT = pathlib.Path("/app/report.json")
ORDERS = pathlib.Path("/app/orders.json")
EXPECTED = {'acme': 20.0, 'globex': 23.46, 'initech': 0}


def test_report_is_json_object():
    assert isinstance(json.loads(REPORT.read_text()), dict)


def test_customers():
    assert sorted(json.loads(REPORT.read_text())) == sorted(EXPECTED)


def test_totals():
    got = json.loads(REPORT.read_text())
    assert all(abs(got[c] - t) < 0.005 for c, t in EXPECTED.items())


def test_script_recomputes_from_new_orders():
    original = ORDERS.read_text()
    try:
        ORDERS.write_text(json.dumps([{"id": 9, "customer": "zeta", "items": [{"sku": "Z", "qty": 2, "price": 1.25}]}]))
        REPORT.unlink(missing_ok=True)
        subprocess.run(["python3", "/app/report.py"], capture_output=True, timeout=20)
        got = json.loads(REPORT.read_text())
    finally:
        ORDERS.write_text(original)
        subprocess.run(["python3", "/app/report.py"], capture_output=True, timeout=20)
    assert got == {"zeta": 2.5}
