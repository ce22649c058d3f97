import hashlib
import pathlib

OUT = pathlib.Path("/app/unique.txt")
EXPECTED = ['ann@example.com', 'bob@example.org', 'carol@site.net', 'dave@site.net', 'eve@example.com', 'frank@mail.io']
SRC_SHA = '0cd3f1140ca0097bdbd16cfb2079c837c22117ed2dc014453d394ca0dc27fc7b'


def test_output_exists():
    assert OUT.is_file()


def test_all_lowercase_no_duplicates():
    got = OUT.read_text().splitlines()
    assert got and all(x == x.lower() for x in got) and len(got) == len(set(got))


def test_same_addresses():
    assert sorted(OUT.read_text().splitlines()) == sorted(EXPECTED)


def test_first_appearance_order():
    assert OUT.read_text().splitlines() == EXPECTED


def test_input_unchanged():
    assert hashlib.sha256(pathlib.Path("/app/emails.txt").read_bytes()).hexdigest() == SRC_SHA
