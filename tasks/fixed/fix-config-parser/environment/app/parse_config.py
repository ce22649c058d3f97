import json
import sys


def parse(text):
    settings = {}
    for line in text.splitlines():
        key, value = line.split("=")
        settings[key] = value
    return settings


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(json.dumps(parse(f.read())))
