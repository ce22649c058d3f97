import pathlib
import re

OUT = pathlib.Path("/app/top3.txt")
EXPECTED = ['the 10', 'fox 6', 'dog 5']


def lines():
    return OUT.read_text().splitlines()


def test_output_exists():
    assert OUT.is_file()


def test_three_lines_word_count_format():
    got = lines()
    assert len(got) == 3 and all(re.fullmatch(r"[a-z]+ [0-9]+", x) for x in got)


def test_most_frequent_first():
    assert lines()[0] == EXPECTED[0]


def test_exact_top_three():
    assert lines() == EXPECTED
