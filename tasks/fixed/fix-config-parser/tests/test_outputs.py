import json
import subprocess
import tempfile


def parse(text):
    with tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False) as f:
        f.write(text)
    out = subprocess.run(["python3", "/app/parse_config.py", f.name], capture_output=True, text=True, timeout=20)
    return json.loads(out.stdout)


def test_plain_lines():
    assert parse("a=1\nb=two\n") == {"a": "1", "b": "two"}


def test_whitespace_dropped():
    assert parse("  host =  example.org \nport= 8080\n") == {"host": "example.org", "port": "8080"}


def test_comments_and_blank_lines_ignored():
    assert parse("# settings\n\nname = demo\n   \n# end\n") == {"name": "demo"}


def test_value_containing_equals():
    assert parse("url = http://x/?a=1&b=2\n") == {"url": "http://x/?a=1&b=2"}
