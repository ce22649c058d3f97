import json
import subprocess
import tempfile


def wc(text, *flags):
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
        f.write(text)
    return subprocess.run(["python3", "/app/wc.py", *flags, f.name], capture_output=True, text=True, timeout=20)


def test_plain_counts():
    assert wc("a b\nc\n").stdout.split() == ["2", "3", "6"]


def test_no_trailing_newline():
    assert wc("one two  three").stdout.split() == ["0", "3", "14"]


def test_unicode_counts_characters():
    assert wc("h\u00e9llo w\u00f6rld\n").stdout.split() == ["1", "2", "12"]


def test_json_output():
    assert json.loads(wc("x y\nz\n", "--json").stdout) == {"lines": 2, "words": 3, "chars": 6}


def test_missing_file():
    out = subprocess.run(["python3", "/app/wc.py", "/nonexistent/file.txt"], capture_output=True, text=True, timeout=20)
    assert out.returncode == 1 and out.stderr.strip() and not out.stdout.strip()
