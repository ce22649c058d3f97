import hashlib
import pathlib

RENAMED = {'/app/photos/beach.jpg': 'a9197ae2f7c9a09f898fc457cfdf85e2224219cd80c2284957862c58f173b8fb', '/app/photos/2023/party night.jpg': '0853ffa61ac288d94c3a0106cada5a949baf2d0f504c43a23b8a5022aa35a4bd', '/app/photos/2024/trip/mountain.jpg': '961e421e008581ee084c6b0b5d62acb289a479c7801237224d15de76707dd8a7'}
KEPT = {'/app/photos/2023/cake.png': '5347428a86447b1b4c4b27f2252f20328d3c9c859c269e751e851e9ed3332c20', '/app/photos/2024/notes.jpeg.txt': 'c63c33f09afc4e0b10663575ad8f1597955decaf5af8835f47490cd751ed8729', '/app/photos/2024/sunset.jpg': 'c27316559580d1e21c456a6ba7916df5ad34788e1c65ec9bee13aa65804b92c9', '/app/photos/readme.md': '0e52aca9904cbe98627a70193f7f63a915cfb76f9624b7a201bebb8c48d9a306'}


def sha(p):
    return hashlib.sha256(pathlib.Path(p).read_bytes()).hexdigest()


def test_no_jpeg_left():
    assert not [p for p in pathlib.Path("/app/photos").rglob("*.jpeg")]


def test_renamed_files_exist():
    assert all(pathlib.Path(p).is_file() for p in RENAMED)


def test_renamed_content_kept():
    assert all(sha(p) == h for p, h in RENAMED.items())


def test_name_with_spaces_renamed():
    assert pathlib.Path("/app/photos/2023/party night.jpg").is_file()


def test_other_files_untouched():
    assert all(pathlib.Path(p).is_file() and sha(p) == h for p, h in KEPT.items())
