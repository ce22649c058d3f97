import json
import pathlib

OUT = pathlib.Path("/app/people.json")
EXPECTED = [{'name': 'Ada', 'age': 36, 'city': 'London'}, {'name': 'Grace', 'age': 45, 'city': 'New York'}, {'name': 'Linus', 'age': 28, 'city': 'Portland, OR'}, {'name': 'Margaret', 'age': 52, 'city': 'Boston'}]


def data():
    return json.loads(OUT.read_text())


def test_json_array_of_rows():
    got = data()
    assert isinstance(got, list) and len(got) == len(EXPECTED)


def test_ages_are_numbers():
    assert all(isinstance(p["age"], int) for p in data())


def test_quoted_comma_field():
    assert data()[2]["city"] == "Portland, OR"


def test_exact_content_in_order():
    assert data() == EXPECTED
