import subprocess
import tempfile


def stats(numbers):
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(numbers)
    out = subprocess.run(["bash", "/app/stats.sh", f.name], capture_output=True, text=True, timeout=20)
    return out.stdout.strip()


def test_positive_numbers():
    assert stats("3\n1\n5\n") == "1 5 3.00"


def test_fractional_mean():
    assert stats("1\n2\n4\n") == "1 4 2.33"


def test_negative_numbers():
    assert stats("-4\n-9\n-2\n") == "-9 -2 -5.00"


def test_single_number_and_blank_lines():
    assert stats("\n7\n\n") == "7 7 7.00"


def test_prints_three_fields():
    assert len(stats("10\n20\n").split()) == 3
