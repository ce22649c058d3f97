import os
from pathlib import Path

OUT = Path("/app/out_of_stock.txt")


def test_output_exists():
    assert OUT.is_file()


def test_only_zero_quantity_items():
    names = OUT.read_text().split()
    assert names and not {"bolts", "washers", "springs"} & set(names)


def test_exact_order():
    assert OUT.read_text().splitlines() == ["nuts", "gears", "rivets"]


def test_tests_dir_env_points_here():
    # TB1 convention: the tests directory is named by $TEST_DIR.
    assert (Path(os.environ["TEST_DIR"]) / "test_outputs.py").is_file()
