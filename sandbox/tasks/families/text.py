"""Short text-processing families: wc, sort, sed, head, grep on a generated file."""

from __future__ import annotations

import random

from sandbox.tasks.families.common import STEMS, WORDS, TaskSpec, distinct_words, ident, sha_of

# Lowercase words only: `sort` orders them the same under the C locale and any UTF-8 locale.


def _word_lines(rng: random.Random, n: int, *, exclude: tuple[str, ...] = ()) -> list[str]:
    pool = [w for w in WORDS if not any(w in e or e in w for e in exclude)]
    return [" ".join(rng.choices(pool, k=rng.randint(1, 3))) for _ in range(n)]


def count_lines(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    src = f"/app/data/{rng.choice(('sales', 'users', 'orders', 'events', 'scores'))}_{tag}.csv"
    out = f"/app/count_{tag}.txt"
    n = rng.randint(4, 40)
    content = "".join(f"{i},{rng.choice(WORDS)},{rng.randint(1, 999)}\n" for i in range(1, n + 1))
    return TaskSpec(
        instruction=f"Count the lines of {src} and write the number to {out}.",
        files={src: content}, solution=f"wc -l < {src} > {out}", category="text",
        constants={"SRC": src, "OUT": out, "N": n, "SRC_SHA": sha_of(content)},
        tests="""
        def test_output_exists():
            assert pathlib.Path(OUT).is_file()

        def test_output_is_a_number():
            assert read(OUT).strip().isdigit()

        def test_count_is_correct():
            assert int(read(OUT).strip()) == N

        def test_input_unchanged():
            assert sha(SRC) == SRC_SHA
        """)


def sort_file(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    s1, s2 = rng.sample(STEMS, 2)
    src, out = f"/app/{s1}_{tag}.txt", f"/app/{s2}_{tag}_sorted.txt"
    words = rng.sample(WORDS, rng.randint(4, 10)) + [rng.choice(WORDS)]
    while words == sorted(words):  # distinct words: some order is unsorted
        rng.shuffle(words)
    content = "".join(w + "\n" for w in words)
    return TaskSpec(
        instruction=f"Sort the lines of {src} into {out}.",
        files={src: content}, solution=f"sort {src} > {out}", category="text",
        constants={"SRC": src, "OUT": out, "WORDS": words, "SRC_SHA": sha_of(content)},
        tests="""
        def test_output_exists():
            assert pathlib.Path(OUT).is_file()

        def test_same_lines():
            assert sorted(read(OUT).splitlines()) == sorted(WORDS)

        def test_lines_sorted():
            lines = read(OUT).splitlines()
            assert lines and lines == sorted(lines)

        def test_input_unchanged():
            assert sha(SRC) == SRC_SHA
        """)


def replace_word(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    target = f"/app/{rng.choice(STEMS)}_{tag}.txt"
    old, new = distinct_words(rng, 2)
    while old in new or new in old:
        old, new = distinct_words(rng, 2)
    lines = _word_lines(rng, rng.randint(4, 8), exclude=(old, new))
    for i in rng.sample(range(len(lines)), rng.randint(2, len(lines) - 1)):
        words = lines[i].split()
        words.insert(rng.randint(0, len(words)), old)
        lines[i] = " ".join(words)
    content = "".join(line + "\n" for line in lines)
    expected = content.replace(old, new)
    return TaskSpec(
        instruction=f"Replace every {old} with {new} in the file {target}.",
        files={target: content}, solution=f"sed -i 's/{old}/{new}/g' {target}", category="text",
        constants={"TARGET": target, "OLD": old, "NEW": new, "COUNT": expected.count(new),
                   "EXPECTED": expected, "NUM_LINES": len(lines)},
        tests="""
        def test_old_word_gone():
            assert OLD not in read(TARGET)

        def test_new_word_count():
            assert read(TARGET).count(NEW) == COUNT

        def test_exact_content():
            assert read(TARGET) == EXPECTED

        def test_line_count_kept():
            assert len(read(TARGET).splitlines()) == NUM_LINES
        """)


def head_lines(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    s1 = rng.choice(STEMS)
    src, out = f"/app/{s1}_{tag}.txt", f"/app/top_{tag}.txt"
    lines = _word_lines(rng, rng.randint(8, 20))
    n = rng.randint(2, 6)
    content = "".join(line + "\n" for line in lines)
    return TaskSpec(
        instruction=f"Write the first {n} lines of {src} to {out}.",
        files={src: content}, solution=f"head -n {n} {src} > {out}", category="text",
        constants={"SRC": src, "OUT": out, "N": n, "EXPECTED": lines[:n], "SRC_SHA": sha_of(content)},
        tests="""
        def test_output_exists():
            assert pathlib.Path(OUT).is_file()

        def test_line_count():
            assert len(read(OUT).splitlines()) == N

        def test_exact_lines():
            assert read(OUT).splitlines() == EXPECTED

        def test_input_unchanged():
            assert sha(SRC) == SRC_SHA
        """)


def grep_lines(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    src, out = f"/app/{rng.choice(('log', 'events', 'notes', 'journal'))}_{tag}.txt", f"/app/match_{tag}.txt"
    (word,) = distinct_words(rng, 1)
    lines = _word_lines(rng, rng.randint(8, 16), exclude=(word,))
    for i in rng.sample(range(len(lines)), rng.randint(2, 4)):
        lines[i] = f"{lines[i]} {word}"
    content = "".join(line + "\n" for line in lines)
    return TaskSpec(
        instruction=f"Write the lines of {src} that contain {word} to {out}.",
        files={src: content}, solution=f"grep {word} {src} > {out}", category="text",
        constants={"SRC": src, "OUT": out, "WORD": word, "EXPECTED": [x for x in lines if word in x],
                   "SRC_SHA": sha_of(content)},
        tests="""
        def test_output_exists():
            assert pathlib.Path(OUT).is_file()

        def test_every_line_matches():
            lines = read(OUT).splitlines()
            assert lines and all(WORD in line for line in lines)

        def test_exact_lines():
            assert read(OUT).splitlines() == EXPECTED

        def test_input_unchanged():
            assert sha(SRC) == SRC_SHA
        """)
