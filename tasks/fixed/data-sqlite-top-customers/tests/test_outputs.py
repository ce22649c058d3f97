import pathlib
import sqlite3

OUT = pathlib.Path("/app/top_customers.txt")
EXPECTED = ['Initech,301.25', 'Globex,255.50', 'Acme,219.00']


def lines():
    return OUT.read_text().splitlines()


def test_three_lines():
    assert len(lines()) == 3


def test_top_customer_first():
    assert lines()[0] == EXPECTED[0]


def test_exact_lines():
    assert lines() == EXPECTED


def test_database_unchanged():
    db = sqlite3.connect("file:/app/shop.db?mode=ro", uri=True)
    assert db.execute("SELECT COUNT(*), SUM(amount) FROM orders").fetchone() == (11, 1013.25)
