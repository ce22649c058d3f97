"""Short file-operation families: one bash command whose arguments appear verbatim in the instruction."""

from __future__ import annotations

import random

from sandbox.tasks.families.common import STEMS, TaskSpec, distinct_words, ident, sha_of


def _distractors(rng: random.Random, tag: str) -> dict[str, str]:
    """Files the agent must leave alone (the 'nothing else clobbered' verifier)."""
    a, b = distinct_words(rng, 2)
    return {f"/app/readme_{tag}.txt": f"{a}\n", f"/app/data/keep_{tag}.txt": f"{a}\n{b}\n"}


def _hashes(files: dict[str, str]) -> dict[str, str]:
    return {p: sha_of(c) for p, c in files.items()}


def create_file(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    target = f"/app/{rng.choice(STEMS)}_{tag}.txt"
    (word,) = distinct_words(rng, 1)
    files = _distractors(rng, tag)
    return TaskSpec(
        instruction=f"Create the file {target} containing the word {word}.",
        files=files, solution=f"echo {word} > {target}", category="files",
        constants={"TARGET": target, "WORD": word, "OTHERS": _hashes(files)},
        tests="""
        def test_file_exists():
            assert pathlib.Path(TARGET).is_file()

        def test_contains_word():
            assert WORD in read(TARGET)

        def test_exact_content():
            assert read(TARGET).strip() == WORD

        def test_other_files_unchanged():
            assert unchanged(OTHERS)
        """)


def append_line(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    target = f"/app/{rng.choice(STEMS)}_{tag}.txt"
    *lines, text = distinct_words(rng, rng.randint(3, 6))
    files = {target: "".join(w + "\n" for w in lines), **_distractors(rng, tag)}
    others = {p: c for p, c in files.items() if p != target}
    return TaskSpec(
        instruction=f"Append the line {text} to the file {target}.",
        files=files, solution=f"echo {text} >> {target}", category="files",
        constants={"TARGET": target, "TEXT": text, "ORIGINAL": lines, "OTHERS": _hashes(others)},
        tests="""
        def test_last_line_is_text():
            assert read(TARGET).splitlines()[-1] == TEXT

        def test_original_lines_kept_in_order():
            assert read(TARGET).splitlines()[:-1] == ORIGINAL

        def test_text_appears_once():
            assert read(TARGET).splitlines().count(TEXT) == 1

        def test_other_files_unchanged():
            assert unchanged(OTHERS)
        """)


def make_dir(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    a, b = distinct_words(rng, 2)
    parent, target = f"/app/{a}_{tag}", f"/app/{a}_{tag}/{b}"
    files = _distractors(rng, tag)
    return TaskSpec(
        instruction=f"Make the directory {target}.",
        files=files, solution=f"mkdir -p {target}", category="files",
        constants={"PARENT": parent, "TARGET": target, "OTHERS": _hashes(files)},
        tests="""
        def test_parent_is_directory():
            assert pathlib.Path(PARENT).is_dir()

        def test_target_is_directory():
            assert pathlib.Path(TARGET).is_dir() and not pathlib.Path(TARGET).is_symlink()

        def test_target_is_empty():
            assert pathlib.Path(TARGET).is_dir() and not any(pathlib.Path(TARGET).iterdir())

        def test_other_files_unchanged():
            assert unchanged(OTHERS)
        """)


def copy_file(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    s1, s2 = rng.sample(STEMS, 2)
    src, dst = f"/app/data/{s1}_{tag}.txt", f"/app/{s2}_{tag}.txt"
    content = "".join(w + "\n" for w in distinct_words(rng, rng.randint(2, 5)))
    files = {src: content, **_distractors(rng, tag)}
    return TaskSpec(
        instruction=f"Copy the file {src} to {dst}.",
        files=files, solution=f"cp {src} {dst}", category="files",
        constants={"SRC": src, "DST": dst, "CONTENT": content, "OTHERS": _hashes(files)},
        tests="""
        def test_copy_exists():
            assert pathlib.Path(DST).is_file()

        def test_copy_content():
            assert read(DST) == CONTENT

        def test_copy_is_not_a_link():
            assert pathlib.Path(DST).is_file() and not pathlib.Path(DST).is_symlink()

        def test_source_and_others_unchanged():
            assert unchanged(OTHERS)
        """)


def rename_file(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    s1, s2 = rng.sample(STEMS, 2)
    src, dst = f"/app/{s1}_{tag}.txt", f"/app/{s2}_{tag}.txt"
    content = "".join(w + "\n" for w in distinct_words(rng, rng.randint(2, 5)))
    others = _distractors(rng, tag)
    return TaskSpec(
        instruction=f"Rename the file {src} to {dst}.",
        files={src: content, **others}, solution=f"mv {src} {dst}", category="files",
        constants={"SRC": src, "DST": dst, "CONTENT": content, "OTHERS": _hashes(others)},
        tests="""
        def test_new_name_exists():
            assert pathlib.Path(DST).is_file()

        def test_content_kept():
            assert read(DST) == CONTENT

        def test_old_name_gone():
            assert not pathlib.Path(SRC).exists()

        def test_other_files_unchanged():
            assert unchanged(OTHERS)
        """)


def chmod_exec(rng: random.Random) -> TaskSpec:
    tag = ident(rng)
    target = f"/app/{rng.choice(('run', 'hello', 'greet', 'build', 'start'))}_{tag}.sh"
    (word,) = distinct_words(rng, 1)
    script = f"#!/bin/bash\necho {word}\n"
    return TaskSpec(
        instruction=f"Make the script {target} executable.",
        files={target: script}, solution=f"chmod +x {target}", category="permissions",
        constants={"TARGET": target, "WORD": word, "SCRIPT_SHA": sha_of(script)},
        tests="""
        def test_owner_can_execute():
            assert os.stat(TARGET).st_mode & stat.S_IXUSR

        def test_runs_and_prints_word():
            assert run([TARGET]).stdout.strip() == WORD

        def test_script_unchanged():
            assert sha(TARGET) == SCRIPT_SHA
        """)
