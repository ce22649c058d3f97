import os
import pathlib
import stat

SITE = pathlib.Path("/app/site")
CONTENT = {'/app/site/index.html': '<h1>hi</h1>\n', '/app/site/css/style.css': 'body{}\n', '/app/site/bin/deploy.sh': '#!/bin/bash\necho deploy\n', '/app/site/bin/backup.sh': '#!/bin/bash\necho backup\n', '/app/site/secret.key': 's3cr3t\n', '/app/site/docs/guide.txt': 'read me\n'}


def mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_directories_755():
    dirs = [SITE] + [p for p in SITE.rglob("*") if p.is_dir()]
    assert all(mode(d) == 0o755 for d in dirs)


def test_plain_files_644():
    files = [p for p in SITE.rglob("*") if p.is_file() and p.parent.name != "bin" and p.name != "secret.key"]
    assert files and all(mode(f) == 0o644 for f in files)


def test_bin_files_755():
    assert all(mode(f) == 0o755 for f in (SITE / "bin").iterdir())


def test_secret_key_600():
    assert mode(SITE / "secret.key") == 0o600


def test_contents_unchanged():
    assert all(pathlib.Path(p).read_text() == c for p, c in CONTENT.items())
