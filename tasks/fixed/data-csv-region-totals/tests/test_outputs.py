import hashlib
import pathlib

OUT = pathlib.Path("/app/region_totals.csv")
EXPECTED = ['region,total', 'west,310.00', 'north,200.50', 'south,179.95', 'east,47.25']


def lines():
    return OUT.read_text().splitlines()


def test_header():
    assert lines()[0] == "region,total"


def test_one_row_per_region():
    assert sorted(x.split(",")[0] for x in lines()[1:]) == sorted(x.split(",")[0] for x in EXPECTED[1:])


def test_totals_two_decimals():
    assert sorted(lines()[1:]) == sorted(EXPECTED[1:])


def test_sorted_largest_first():
    assert lines() == EXPECTED


def test_input_unchanged():
    assert hashlib.sha256(pathlib.Path("/app/sales.csv").read_bytes()).hexdigest() == 'a535e6f6c60abb87d2f96d51c79929317f852f1a33caa0142ff9d81719294417'
