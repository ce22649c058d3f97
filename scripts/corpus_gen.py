"""Seeded generator of the built-in tokenizer's training text (t1model/assets/corpus/*.txt).

Synthetic but shaped like what an agent reads and writes in a terminal: shell sessions with their output
(listings, git, pytest, pip, make, tracebacks), data files (CSV, JSON, YAML, TOML, logs), small source files,
task instructions, and ChatML episodes with Qwen3-style tool calls. `write_corpus(dir)` is deterministic.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

WORDS = ("data config report server client utils main test model train eval parse build deploy cache index "
         "record user order invoice metrics logs backup archive script notes readme schema migrate worker queue "
         "api handler router service storage bucket upload download export import sample result output input "
         "table column value count total average score label token vector matrix graph node edge tree path").split()
EXTS = ["py", "txt", "csv", "json", "sh", "md", "yaml", "toml", "log", "c", "h", "js", "ts", "rs", "go", "cfg",
        "ini", "sql", "html", "xml", "tar.gz", "zip"]
DIRS = ["src", "tests", "docs", "scripts", "data", "build", "lib", "bin", "config", "app", "tmp", "logs", "out"]
USERS = ["root", "user", "agent", "ubuntu", "www-data", "postgres", "dev"]
MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
ERRORS = [("FileNotFoundError", "[Errno 2] No such file or directory: '{f}'"),
          ("KeyError", "'{w}'"), ("ValueError", "invalid literal for int() with base 10: '{w}'"),
          ("TypeError", "unsupported operand type(s) for +: 'int' and 'str'"),
          ("ModuleNotFoundError", "No module named '{w}'"), ("IndexError", "list index out of range"),
          ("AttributeError", "'NoneType' object has no attribute '{w}'"), ("ZeroDivisionError", "division by zero"),
          ("PermissionError", "[Errno 13] Permission denied: '{f}'"),
          ("json.decoder.JSONDecodeError", "Expecting value: line {n} column 1 (char {m})"),
          ("AssertionError", "expected {n}, got {m}"), ("RuntimeError", "{w} failed with exit code {n}")]
# Broader vocabulary for prose and identifiers (the BPE needs lexical variety to fill 4096 ids).
PROSE = ("the a an of to in for on with from by at as is are was were be been being this that these those it its "
         "we you they he she them our your their which who what when where why how all any each every some many "
         "more most other such only same than then also just very can could should would may might must will shall "
         "not no yes if else while because although before after during until since about above below between into "
         "through over under again further once here there both few own so too now new old first last next long "
         "short small large big little high low early late good bad best better worse right wrong true false "
         "simple complex quick slow fast safe secure stable empty full valid invalid missing broken correct "
         "expected actual current previous following given required optional default custom local remote global "
         "public private internal external temporary permanent available possible necessary important useful "
         "make use run check read write open close start stop create delete update remove add change keep move "
         "copy find search replace return print show list load save send receive handle process convert compare "
         "count measure test verify ensure allow prevent avoid need want try fail pass succeed finish continue "
         "wait retry skip ignore include exclude contain support accept reject produce generate compute calculate "
         "store fetch install configure compile link execute launch restart monitor inspect debug trace analyze "
         "summarize describe explain document note report assume expect happen seem look call name define set get "
         "file directory folder line word character string number integer float list array dictionary object "
         "function method class module package library program script command option argument parameter variable "
         "field key value pair entry item element record row column header footer section block chunk page "
         "message error warning exception failure problem issue bug fix patch change version release branch commit "
         "repository project task goal step stage phase job work time date hour minute second day week month year "
         "size length width height depth limit range offset index position order format pattern rule policy "
         "permission owner group user account password secret token session request response status code result "
         "input output source target destination origin address host port network connection socket protocol "
         "server client database query transaction schema migration backup snapshot image container volume "
         "process thread signal memory disk cpu load usage performance latency throughput bandwidth quota "
         "system kernel shell terminal environment path variable locale timezone encoding unicode ascii utf "
         "people company customer employee student teacher city country street price cost amount total balance "
         "account invoice payment product order shipment warehouse inventory supplier weather temperature "
         "question answer example reason detail summary description instruction requirement constraint "
         "assumption decision solution approach method strategy algorithm structure design interface behaviour").split()
IDENTS = ("self cls args kwargs init main setup teardown fixture config settings logger logging os sys re json csv "
          "math time datetime random subprocess pathlib shutil argparse collections itertools functools typing "
          "dataclass dataclasses enum abc asyncio threading queue socket http urllib requests numpy pandas torch "
          "sqlite3 hashlib base64 struct gzip zipfile tarfile tempfile glob fnmatch pickle copy pprint textwrap "
          "unittest pytest mock assert isinstance len range enumerate zip sorted reversed append extend pop "
          "items keys values get setdefault update join split strip lstrip rstrip lower upper startswith endswith "
          "encode decode format replace readlines writelines readline exists mkdir makedirs listdir walk stat "
          "getenv environ argv exit stdin stdout stderr returncode check_output Popen communicate timeout "
          "None True False lambda yield async await try except finally raise with import from def class return "
          "pass break continue global nonlocal int str float bool dict tuple bytes bytearray frozenset object "
          "np pd df arr idx tmp buf res ret val cnt num fname fpath dirname basename abspath realpath splitext "
          "int64 float32 uint8 utf8 nan inf dtype shape reshape concat merge groupby apply agg mean median std "
          "sum min max abs round floor ceil sqrt log exp sin cos parse_args add_argument ArgumentParser").split()
COMMANDS = ("ls cd pwd cat head tail less more grep egrep find xargs sed awk cut sort uniq wc tr tee diff patch "
            "cp mv rm mkdir rmdir touch ln chmod chown chgrp stat file du df free top ps kill pkill pgrep nohup "
            "tar gzip gunzip zip unzip curl wget ssh scp rsync git make cmake gcc g++ clang ld python python3 pip "
            "pip3 node npm yarn cargo rustc go java javac mvn gradle docker apt apt-get dpkg systemctl service "
            "journalctl crontab env export source which whereis type alias history echo printf read test true "
            "false sleep date cal uptime whoami id hostname uname lsof netstat ss ip ping nslookup dig jq yq "
            "sqlite3 psql mysql redis-cli openssl base64 md5sum sha256sum xxd od strings hexdump nl fold column "
            "paste join comm split csplit basename dirname realpath readlink mktemp seq shuf timeout watch time").split()
VERBS = ["Create", "Write", "Fix", "Implement", "Configure", "Set up", "Find", "Compute", "Convert", "Extract",
         "Repair", "Install", "Build", "Debug", "Refactor", "Parse", "Sort", "Merge", "Compress", "Validate"]


def _name(r: random.Random, ext: str | None = None) -> str:
    base = r.choice(WORDS) + (r.choice(["_", "-", ""]) + r.choice(WORDS) if r.random() < 0.6 else "")
    if r.random() < 0.2:
        base += str(r.randint(1, 99))
    return f"{base}.{ext or r.choice(EXTS)}"


def _path(r: random.Random) -> str:
    parts = [r.choice(DIRS) for _ in range(r.randint(0, 3))]
    return "/".join([*parts, _name(r)])


def ls_la(r: random.Random) -> str:
    lines = [f"total {r.randint(4, 400)}"]
    entries = [".", ".."] + sorted({_name(r) if r.random() < 0.7 else r.choice(DIRS) for _ in range(r.randint(2, 14))})
    for e in entries:
        is_dir = "." not in e or e in (".", "..")
        perm = r.choice(["drwxr-xr-x", "drwx------", "drwxrwxr-x"]) if is_dir else \
            r.choice(["-rw-r--r--", "-rwxr-xr-x", "-rw-------", "-rw-rw-r--"])
        user = r.choice(USERS)
        size = 4096 if is_dir else r.choice([r.randint(0, 999), r.randint(1000, 99999), r.randint(10**5, 10**7)])
        when = f"{r.choice(MONTHS)} {r.randint(1, 28):>2} {r.randint(0, 23):02d}:{r.randint(0, 59):02d}"
        lines.append(f"{perm} {r.randint(1, 9):>2} {user:<8} {user:<8} {size:>8} {when} {e}")
    return "\n".join(lines)


def git_output(r: random.Random) -> tuple[str, str]:
    kind = r.randrange(5)
    if kind == 0:
        mod = "\n".join(f"\tmodified:   {_path(r)}" for _ in range(r.randint(1, 4)))
        new = "\n".join(f"\t{_path(r)}" for _ in range(r.randint(0, 3)))
        return "git status", (f"On branch {r.choice(['main', 'master', 'dev', 'fix-' + r.choice(WORDS)])}\n"
                              "Changes not staged for commit:\n  (use \"git add <file>...\" to update what will be "
                              f"committed)\n\n{mod}\n\nUntracked files:\n{new}\n\nno changes added to commit")
    if kind == 1:
        rows = [f"{r.getrandbits(28):07x} {r.choice(VERBS)} {r.choice(WORDS)} {r.choice(WORDS)}"
                for _ in range(r.randint(3, 10))]
        return f"git log --oneline -n {len(rows)}", "\n".join(rows)
    if kind == 2:
        f = _name(r, "py")
        a, b = r.choice(WORDS), r.choice(WORDS)
        return f"git diff {f}", (f"diff --git a/{f} b/{f}\nindex {r.getrandbits(28):07x}..{r.getrandbits(28):07x} "
                                 f"100644\n--- a/{f}\n+++ b/{f}\n@@ -{r.randint(1, 80)},7 +{r.randint(1, 80)},8 @@ "
                                 f"def {a}():\n     {a} = load_{b}(path)\n-    return {a}\n+    if {a} is None:\n"
                                 f"+        raise ValueError(\"missing {b}\")\n+    return {a}")
    if kind == 3:
        msg = f"{r.choice(VERBS)} {r.choice(WORDS)} {r.choice(WORDS)}"
        return f"git commit -am \"{msg}\"", (f"[main {r.getrandbits(28):07x}] {msg}\n {r.randint(1, 9)} files "
                                             f"changed, {r.randint(1, 300)} insertions(+), {r.randint(0, 90)} "
                                             "deletions(-)")
    repo = r.choice(WORDS)
    return f"git clone https://example.com/{r.choice(USERS)}/{repo}.git", (
        f"Cloning into '{repo}'...\nremote: Enumerating objects: {r.randint(10, 9000)}, done.\n"
        f"Receiving objects: 100% ({r.randint(10, 9000)}/{r.randint(10, 9000)}), done.\n"
        f"Resolving deltas: 100% ({r.randint(1, 900)}/{r.randint(1, 900)}), done.")


def traceback(r: random.Random) -> str:
    frames = []
    for _ in range(r.randint(1, 4)):
        f = _path(r).rsplit(".", 1)[0] + ".py"
        fn = f"{r.choice(WORDS)}_{r.choice(WORDS)}"
        frames.append(f"  File \"/app/{f}\", line {r.randint(1, 400)}, in {fn}\n"
                      f"    {r.choice(WORDS)} = {fn}({r.choice(WORDS)}, {r.choice(WORDS)}={r.randint(0, 9)})")
    err, msg = r.choice(ERRORS)
    msg = msg.format(f=_path(r), w=r.choice(WORDS), n=r.randint(1, 99), m=r.randint(100, 999))
    return "Traceback (most recent call last):\n" + "\n".join(frames) + f"\n{err}: {msg}"


def pytest_output(r: random.Random) -> str:
    tests = [f"tests/test_{r.choice(WORDS)}.py::test_{r.choice(WORDS)}_{r.choice(WORDS)}" for _ in range(r.randint(2, 8))]
    results = [(t, r.choice(["PASSED", "PASSED", "PASSED", "FAILED"])) for t in tests]
    failed = sum(s == "FAILED" for _, s in results)
    head = (f"============================= test session starts ==============================\n"
            f"platform linux -- Python 3.{r.randint(8, 12)}.{r.randint(0, 12)}, pytest-{r.randint(6, 8)}.{r.randint(0, 4)}"
            f".{r.randint(0, 3)}, pluggy-1.5.0\nrootdir: /app\ncollected {len(tests)} items\n\n")
    body = "\n".join(f"{t} {s}" for t, s in results)
    summary = "\n".join(f"{s} {t}" for t, s in results)
    tail = f"{failed} failed, {len(tests) - failed} passed" if failed else f"{len(tests)} passed"
    return (head + body + "\n\n=========================== short test summary info ============================\n"
            + summary + f"\n========================= {tail} in {r.uniform(0.01, 9):.2f}s =========================")


def csv_snippet(r: random.Random) -> str:
    cols = r.sample(["id", "name", "age", "city", "price", "qty", "date", "score", "email", "status", "region"],
                    r.randint(3, 6))
    rows = [",".join(cols)]
    for i in range(r.randint(3, 12)):
        vals = []
        for c in cols:
            vals.append({"id": str(i + 1), "name": r.choice(["alice", "bob", "carol", "dave", "erin", "frank"]),
                         "age": str(r.randint(18, 90)), "city": r.choice(["Paris", "Berlin", "Tokyo", "Lima", "Oslo"]),
                         "price": f"{r.uniform(0, 500):.2f}", "qty": str(r.randint(0, 40)),
                         "date": f"2024-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
                         "score": f"{r.random():.3f}", "email": f"{r.choice(WORDS)}@example.com",
                         "status": r.choice(["ok", "failed", "pending"]),
                         "region": r.choice(["eu-west", "us-east", "ap-south"])}[c])
        rows.append(",".join(vals))
    return "\n".join(rows)


def json_snippet(r: random.Random) -> str:
    obj = {r.choice(WORDS): r.choice([r.randint(0, 9999), r.random(), r.choice(WORDS), True, None,
                                      [r.randint(0, 9) for _ in range(3)], {r.choice(WORDS): r.choice(WORDS)}])
           for _ in range(r.randint(2, 7))}
    return json.dumps(obj, indent=r.choice([None, 2, 4]))


def config_file(r: random.Random) -> tuple[str, str]:
    kind = r.randrange(4)
    name = r.choice(WORDS)
    if kind == 0:
        return "config.yaml", (f"{name}:\n  host: 127.0.0.1\n  port: {r.randint(1024, 65535)}\n  workers: "
                               f"{r.randint(1, 16)}\n  debug: {r.choice(['true', 'false'])}\nlogging:\n  level: "
                               f"{r.choice(['INFO', 'DEBUG', 'WARNING'])}\n  file: /var/log/{name}.log")
    if kind == 1:
        return "pyproject.toml", (f"[project]\nname = \"{name}\"\nversion = \"0.{r.randint(0, 9)}.{r.randint(0, 9)}\"\n"
                                  f"requires-python = \">=3.{r.randint(8, 11)}\"\ndependencies = [\"numpy\", "
                                  f"\"requests>=2.{r.randint(20, 31)}\"]\n\n[tool.pytest.ini_options]\ntestpaths = "
                                  "[\"tests\"]")
    if kind == 2:
        return "Dockerfile", (f"FROM python:3.{r.randint(9, 12)}-slim\nWORKDIR /app\nRUN apt-get update && apt-get "
                              f"install -y --no-install-recommends {r.choice(['curl', 'git', 'jq', 'sqlite3'])} && rm -rf "
                              "/var/lib/apt/lists/*\nCOPY . /app\nRUN pip install --no-cache-dir -r requirements.txt\n"
                              f"CMD [\"python\", \"{name}.py\"]")
    return "Makefile", (f"CC = gcc\nCFLAGS = -O2 -Wall\n\n{name}: {name}.o utils.o\n\t$(CC) $(CFLAGS) -o $@ $^\n\n"
                        f"%.o: %.c\n\t$(CC) $(CFLAGS) -c $<\n\nclean:\n\trm -f *.o {name}")


def python_source(r: random.Random) -> str:
    a, b, c = r.sample(WORDS, 3)
    return (f"import json\nimport sys\nfrom pathlib import Path\n\n\ndef load_{a}(path: str) -> list[dict]:\n"
            f"    with open(path) as f:\n        return [json.loads(line) for line in f if line.strip()]\n\n\n"
            f"def {b}_{c}(rows: list[dict], key: str = \"{c}\") -> dict[str, int]:\n    counts: dict[str, int] = {{}}\n"
            f"    for row in rows:\n        counts[row[key]] = counts.get(row[key], 0) + 1\n    return counts\n\n\n"
            f"if __name__ == \"__main__\":\n    rows = load_{a}(sys.argv[1])\n    print(json.dumps({b}_{c}(rows), "
            "indent=2))")


def shell_command(r: random.Random) -> tuple[str, str]:
    """A command and a plausible output."""
    kind = r.randrange(12)
    f, w = _path(r), r.choice(WORDS)
    if kind == 0:
        return "ls -la" + r.choice(["", " /app", f" {r.choice(DIRS)}"]), ls_la(r)
    if kind == 1:
        return f"grep -rn \"{w}\" {r.choice(DIRS)}/", "\n".join(
            f"{_path(r)}:{r.randint(1, 300)}:    {w} = {r.choice(WORDS)}({r.choice(WORDS)})" for _ in range(r.randint(0, 5)))
    if kind == 2:
        return f"find . -name \"*.{r.choice(EXTS)}\" -type f", "\n".join("./" + _path(r) for _ in range(r.randint(1, 8)))
    if kind == 3:
        return f"wc -l {f}", f"{r.randint(0, 5000)} {f}"
    if kind == 4:
        return f"head -n {r.randint(3, 12)} {_name(r, 'csv')}", csv_snippet(r)
    if kind == 5:
        return f"cat {_name(r, 'json')}", json_snippet(r)
    if kind == 6:
        return f"python3 {_name(r, 'py')}", traceback(r)
    if kind == 7:
        return "python3 -m pytest -rA " + r.choice(["", "tests/", "-x -q"]), pytest_output(r)
    if kind == 8:
        pkg = r.choice(["numpy", "pandas", "requests", "flask", "pyyaml", "scipy"])
        return f"pip install {pkg}", (f"Collecting {pkg}\n  Downloading {pkg}-{r.randint(1, 3)}.{r.randint(0, 30)}.0"
                                      f"-py3-none-any.whl ({r.uniform(0.1, 30):.1f} MB)\nInstalling collected packages:"
                                      f" {pkg}\nSuccessfully installed {pkg}-{r.randint(1, 3)}.{r.randint(0, 30)}.0")
    if kind == 9:
        return git_output(r)
    if kind == 10:
        return f"make {w}", (f"gcc -O2 -Wall -c {w}.c\n{w}.c:{r.randint(1, 200)}:{r.randint(1, 40)}: warning: unused "
                             f"variable '{r.choice(WORDS)}' [-Wunused-variable]\ngcc -O2 -Wall -o {w} {w}.o utils.o")
    cmd = r.choice([f"mkdir -p {r.choice(DIRS)}/{w}", f"chmod +x {_name(r, 'sh')}", f"cd {r.choice(DIRS)}",
                    f"sed -i 's/{w}/{r.choice(WORDS)}/g' {f}", f"tar -czf {w}.tar.gz {r.choice(DIRS)}/",
                    f"echo \"{w}\" > {f}", f"cp {f} /tmp/", f"rm -f {f}", f"export {w.upper()}_PATH=/opt/{w}"])
    return cmd, ""


def prose(r: random.Random) -> str:
    """Loose English-like sentences over the prose vocabulary (notes, README text, commit bodies)."""
    sentences = []
    for _ in range(r.randint(2, 6)):
        words = [r.choice(PROSE) for _ in range(r.randint(6, 18))]
        if r.random() < 0.3:
            words.insert(r.randrange(len(words)), f"`{r.choice(IDENTS + COMMANDS)}`")
        if r.random() < 0.2:
            words.insert(r.randrange(len(words)), r.choice([_path(r), str(r.randint(0, 10**r.randint(1, 6)))]))
        sentences.append(" ".join(words).capitalize() + r.choice([".", ".", ".", "?", ":", "!"]))
    return " ".join(sentences)


def code_lines(r: random.Random) -> str:
    """Python-ish and shell-ish lines over identifier and command vocabularies."""
    out = []
    for _ in range(r.randint(3, 10)):
        a, b, c = r.choice(IDENTS), r.choice(IDENTS + PROSE), r.choice(IDENTS)
        out.append(r.choice([
            f"{a}_{b} = {c}.{r.choice(IDENTS)}({r.choice(IDENTS)}, {b}={r.randint(0, 99)})",
            f"if {a} is not None and {b} in {c}:", f"    return {{\"{a}\": {b}, \"{c}\": {r.random():.2f}}}",
            f"for {a}, {b} in enumerate({c}):", f"from {a} import {b}, {c}", f"# {prose(r)[:80]}",
            f"{r.choice(COMMANDS)} -{r.choice('alnrvxf')} {_path(r)} | {r.choice(COMMANDS)} {r.choice(PROSE)}",
            f"{r.choice(COMMANDS)} --{r.choice(PROSE)}-{r.choice(PROSE)} {_path(r)}",
            f"def {a}_{r.choice(PROSE)}(self, {b}: {r.choice(['int', 'str', 'list[str]', 'dict'])}) -> None:",
        ]))
    return "\n".join(out)


def instruction(r: random.Random) -> str:
    verb, a, b = r.choice(VERBS), r.choice(WORDS), r.choice(WORDS)
    out = _path(r)
    parts = [f"{verb} a {r.choice(['script', 'program', 'CLI tool', 'service', 'pipeline'])} that {r.choice(['reads', 'processes', 'cleans', 'summarises', 'validates'])} "
             f"the {a} files in /app/{r.choice(DIRS)} and writes the {b} to /app/{out}.",
             f"The output must be {r.choice(['valid JSON', 'a CSV file with a header row', 'sorted by date', 'one line per record'])}.",
             r.choice(["Do not modify the tests.", "Use only the Python standard library.",
                       f"The file must be executable and finish within {r.randint(5, 120)} seconds.",
                       "Handle empty input gracefully.", f"Make sure `{_name(r, 'sh')}` exits with status 0."]),
             r.choice(["", f"Hint: the {a} data contains malformed lines.", "You have root access in the container.",
                       prose(r)])]
    return " ".join(p for p in parts if p)


def episode(r: random.Random) -> str:
    """One ChatML agent episode with Qwen3 tool calls and tool responses."""
    sys_msg = ("You are an autonomous agent working in a Linux terminal. Use the bash tool to run one command at a "
               "time, read the output, and keep going until the task is done.")
    text = [f"<|im_start|>system\n{sys_msg}<|im_end|>\n<|im_start|>user\n{instruction(r)}<|im_end|>\n"]
    for _ in range(r.randint(2, 6)):
        cmd, out = shell_command(r)
        think = (f"<think>\nI should {r.choice(['check', 'look at', 'inspect', 'run'])} the {r.choice(WORDS)} "
                 f"first.\n</think>\n\n" if r.random() < 0.4 else "")
        call = json.dumps({"name": "bash", "arguments": {"command": cmd}}, ensure_ascii=False)
        text.append(f"<|im_start|>assistant\n{think}<tool_call>\n{call}\n</tool_call><|im_end|>\n")
        text.append(f"<|im_start|>user\n<tool_response>\n{out}\n</tool_response><|im_end|>\n")
    text.append(f"<|im_start|>assistant\nThe task is complete: {r.choice(WORDS)} {r.choice(['written', 'fixed', 'passing'])}."
                "<|im_end|>\n")
    return "".join(text)


def session(r: random.Random) -> str:
    user, host, cwd = r.choice(USERS), r.choice(WORDS) + "-" + str(r.randint(1, 9)), "/" + r.choice(["app", "root", "home/" + r.choice(USERS)])
    lines = []
    for _ in range(r.randint(3, 8)):
        cmd, out = shell_command(r)
        lines.append(f"{user}@{host}:{cwd}$ {cmd}" + (f"\n{out}" if out else ""))
    return "\n".join(lines)


def files_text(r: random.Random) -> str:
    name, body = config_file(r)
    if r.random() < 0.5:
        name, body = _name(r, "py"), python_source(r)
    return f"==> {name} <==\n{body}"


GENERATORS: dict[str, tuple[Callable[[random.Random], str], int]] = {
    "shell_sessions.txt": (session, 120),
    "agent_episodes.txt": (episode, 60),
    "instructions.txt": (instruction, 300),
    "files.txt": (files_text, 80),
    "data.txt": (lambda r: csv_snippet(r) if r.random() < 0.5 else json_snippet(r), 120),
    "tracebacks.txt": (lambda r: traceback(r) + "\n\n" + pytest_output(r), 50),
    "notes.txt": (prose, 700),
    "code.txt": (code_lines, 500),
}


def write_corpus(out_dir: Path, *, seed: int = 1234) -> dict[str, int]:
    """Write every corpus file (each from its own seeded stream); returns bytes per file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for i, (fname, (gen, count)) in enumerate(sorted(GENERATORS.items())):
        r = random.Random(seed * 1000 + i)
        text = "\n\n".join(gen(r) for _ in range(count)) + "\n"
        (out_dir / fname).write_text(text)
        sizes[fname] = len(text.encode())
    return sizes
