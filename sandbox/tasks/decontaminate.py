"""Is a training set disjoint from an evaluation set? Pairs of tasks that share text or files.

    python -m sandbox.decontaminate TRAIN_DIR --against EVAL_DIR [EVAL_DIR ...] [--jaccard 0.5] [--common 3]

Each DIR holds task directories (Harbor or Terminal-Bench 1 layout), or is one. A training task and an
evaluation task are reported as a pair when
- their instructions share a span of SPAN_TOKENS (13) normalized tokens (NFKC, lower case, runs of letters and
  digits; punctuation and layout do not count), or
- the Jaccard similarity of their instructions' sets of 5-token shingles is at least `--jaccard`, or
- a file of the training task that carries task-specific content is byte-identical to one of the evaluation
  task's (tests, data, solution, any file other than the instruction and the task's metadata).
Boilerplate is not contamination, judged two ways:
- by content (`task_specific`), however small the evaluation set: a script or Dockerfile (*.sh, Dockerfile,
  docker-compose.yaml) counts only if some command in it is more than set-up (installing packages or a test
  framework, starting the tests, writing the reward file, cd/source/export/echo without redirection, FROM, WORKDIR,
  COPY ...); any other file only if it holds at least MIN_TOKENS distinct normalized tokens (text) or MIN_BYTES
  bytes (binary);
- by frequency: a file or a 13-token span that `--common` or more evaluation tasks share (a base Dockerfile, a
  stock sentence), or that `--common` or more training families share (instances of one generated family count
  once), is left out.

Prints a table of pairs (training task, evaluation task, what they share) and a count. Exit code 1 when any
pair is found, 0 when none, 2 with one line on bad input.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import sys
import tomllib
import unicodedata
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from sandbox.cli import Parser
from sandbox.tasks.format import find_task_dirs

SPAN_TOKENS = 13
"""Length of a shared span that makes a pair (the n-gram length of GPT-3-style decontamination)."""
SHINGLE_TOKENS = 5
"""Shingle length of the Jaccard similarity."""
DEFAULT_JACCARD = 0.5
DEFAULT_COMMON = 3
MIN_TOKENS = 8
"""Distinct normalized tokens that make a text file task-specific (below: 'pytest==8.4.1', a lone '1')..."""
MIN_BYTES = 64
"""... or bytes (of a binary file, or of a text file past its outer whitespace: a fixed-width data record)."""
_TOKEN_RE = re.compile(r"[^\W_]+")
_SCRIPT_NAMES = re.compile(r"(\.sh|(^|/)Dockerfile[^/]*|(^|/)docker-compose\.ya?ml)$")
# One shell command (a line split at && ; || and |) or Dockerfile instruction that is set-up, not the task's own.
_SETUP = re.compile(r"""(
    \#.* | set(\s+\S+)* | (then|else|do|done|fi|esac)\b.* | (if|while|elif)\s+\[.*\]\s* | exit(\s+\S+)? |
    (sudo\s+)?(apt-get|apt|apk|yum|dnf|brew)(\s.*)? | (DEBIAN_FRONTEND=\S+\s+)?apt-get(\s.*)? |
    ((python3?|\S*/python3?)\s+-m\s+)?(pip3?|uv|uvx|pipx|npm|conda)(\s.*)? | (curl|wget)\s.*(install|uv|pip).* |
    (ba)?sh(\s+-\w+)* | (source|\.)\s+\S+ | cd(\s+.*)? | export\s+\w+=\S* | \w+=\S* |
    (if\s+)?(uv\s+run\s+|uvx\s.*|(python3?\s+-m\s+))?pytest(\s.*)? |
    bash\s+\S*(run-tests|test|setup-uv-pytest|run-uv-pytest)\S*\.sh |
    echo(\s+[^>]*)? | echo\s.*>\s*\S*/logs/\S* | mkdir\s+(-p\s+)?\S*/?(logs|tests|app)\S* |
    rm\s+-rf\s+/var/lib/apt/lists\S* |
    (FROM|WORKDIR|ENV|ARG|USER|CMD|ENTRYPOINT|SHELL|LABEL|EXPOSE|COPY|ADD|VOLUME|STOPSIGNAL|HEALTHCHECK)\b.* |
    RUN | version:.* | services:.* | \S+:\s*\S* | -\s+\S+ | \{ | \} )$""", re.VERBOSE)
# The instruction and the task's metadata: compared as text (the instruction) or not at all (timeouts, names).
_NOT_COMPARED = {"instruction.md", "task.toml", "task.yaml"}


@dataclasses.dataclass(frozen=True)
class TaskText:
    """What one task is compared by."""

    name: str
    """Task directory name."""
    path: Path
    family: str
    """[metadata] family of a generated instance; the task's own path otherwise."""
    tokens: tuple[str, ...]
    """The instruction's normalized tokens."""
    files: dict[str, str]
    """sha256 of a file's bytes -> its path relative to the task (the first, when several are identical)."""


@dataclasses.dataclass(frozen=True)
class Overlap:
    """One contaminated pair and its evidence."""

    train: str
    """Training task directory."""
    eval: str
    """Evaluation task directory."""
    kind: str
    """'span', 'jaccard' or 'file'."""
    evidence: str
    """The shared span, the similarity, or the identical files."""


def normalize(text: str) -> tuple[str, ...]:
    """Tokens of `text`: NFKC, lower case, runs of letters and digits (so layout and punctuation never matter)."""
    return tuple(_TOKEN_RE.findall(unicodedata.normalize("NFKC", text).lower()))


def ngrams(tokens: Sequence[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


def read_task(root: Path) -> TaskText:
    """The instruction and file hashes of one task directory (ValueError naming the file when unreadable)."""
    family = str(root.resolve())
    if (root / "task.toml").is_file():
        try:
            meta = tomllib.loads((root / "task.toml").read_text()).get("metadata", {})
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{root / 'task.toml'}: invalid TOML: {e}") from e
        family = str(meta.get("family") or family) if isinstance(meta, dict) else family
        instruction_file = root / "instruction.md"
        if not instruction_file.is_file():
            raise ValueError(f"{instruction_file}: missing")
        instruction = instruction_file.read_text(errors="replace")
    else:
        instruction = _tb1_instruction(root / "task.yaml")
    files: dict[str, str] = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink() or not p.is_file() or p.relative_to(root).as_posix() in _NOT_COMPARED:
            continue
        data = p.read_bytes()
        if task_specific(p.relative_to(root).as_posix(), data):
            files.setdefault(hashlib.sha256(data).hexdigest(), p.relative_to(root).as_posix())
    return TaskText(name=root.name, path=root, family=family, tokens=normalize(instruction), files=files)


def task_specific(rel: str, data: bytes) -> bool:
    """Whether a task file carries content of its own task (see the module docstring): a script or Dockerfile with
    a command beyond set-up, a text file of MIN_TOKENS distinct tokens, a binary file of MIN_BYTES."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return len(data) >= MIN_BYTES
    if "\0" in text:
        return len(data) >= MIN_BYTES
    if _SCRIPT_NAMES.search(rel):
        return any(not _SETUP.fullmatch(cmd) for cmd in _commands(text))
    return len(set(normalize(text))) >= MIN_TOKENS or len(text.strip()) >= MIN_BYTES


def _commands(script: str) -> list[str]:
    """A script's commands: continuation lines joined, split at && || ; and pipes, a RUN prefix dropped."""
    out = []
    for line in re.sub(r"\\\n", " ", script).splitlines():
        line = line.strip()
        if line.startswith("#"):
            continue
        for part in re.split(r"&&|\|\||;|\|", re.sub(r"^RUN\s+", "", line)):
            if part.strip():
                out.append(" ".join(part.split()))
    return out


def _tb1_instruction(path: Path) -> str:
    import yaml  # PyYAML: only the TB1 layout needs it

    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a mapping at top level")
    text = cfg.get("instruction")
    descs = cfg.get("descriptions")
    if not isinstance(text, str) and isinstance(descs, list) and descs and isinstance(descs[0], dict):
        text = descs[0].get("description")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{path}: field 'instruction': missing or empty")
    return text


def _spans(t: TaskText) -> set[tuple[str, ...]]:
    return ngrams(t.tokens, SPAN_TOKENS)


def _file_keys(t: TaskText) -> set[str]:
    return set(t.files)


def _common_keys(tasks: Iterable[TaskText], keys_of: Callable[[TaskText], set], *, by_family: bool, common: int) -> set:
    """Keys (spans, file hashes) that `common` or more tasks (or families, `by_family`) hold."""
    holders: dict[object, set[str]] = defaultdict(set)
    for t in tasks:
        for key in keys_of(t):
            holders[key].add(t.family if by_family else str(t.path))
    return {k for k, who in holders.items() if len(who) >= common}


def find_overlaps(train: list[TaskText], evals: list[TaskText], *, jaccard: float = DEFAULT_JACCARD,
                  common: int = DEFAULT_COMMON) -> list[Overlap]:
    """Every (training task, evaluation task) pair that shares a span, a similar instruction or a file."""
    boiler_spans = (_common_keys(evals, _spans, by_family=False, common=common)
                    | _common_keys(train, _spans, by_family=True, common=common))
    boiler_files = (_common_keys(evals, _file_keys, by_family=False, common=common)
                    | _common_keys(train, _file_keys, by_family=True, common=common))
    span_index: dict[tuple[str, ...], list[int]] = defaultdict(list)
    shingle_index: dict[tuple[str, ...], list[int]] = defaultdict(list)
    file_index: dict[str, list[int]] = defaultdict(list)
    eval_shingles = [ngrams(e.tokens, SHINGLE_TOKENS) for e in evals]
    for j, e in enumerate(evals):
        for s in _spans(e) - boiler_spans:
            span_index[s].append(j)
        for s in eval_shingles[j]:
            shingle_index[s].append(j)
        for h in e.files.keys() - boiler_files:
            file_index[h].append(j)
    out: list[Overlap] = []
    for t in train:
        out += _pairs_of(t, evals, eval_shingles, span_index, shingle_index, file_index, jaccard=jaccard)
    return out


def _pairs_of(t: TaskText, evals: list[TaskText], eval_shingles: list[set], span_index: dict, shingle_index: dict,
              file_index: dict, *, jaccard: float) -> list[Overlap]:
    found: dict[int, list[tuple[str, str]]] = defaultdict(list)
    spans: dict[int, tuple[str, ...]] = {}
    for i in range(len(t.tokens) - SPAN_TOKENS + 1):  # in order: the evidence is the first shared span
        for j in span_index.get(t.tokens[i:i + SPAN_TOKENS], ()):
            spans.setdefault(j, t.tokens[i:i + SPAN_TOKENS])
    for j, s in spans.items():
        found[j].append(("span", " ".join(s)))
    mine = ngrams(t.tokens, SHINGLE_TOKENS)
    for j in {j for s in mine for j in shingle_index.get(s, ())}:
        sim = len(mine & eval_shingles[j]) / len(mine | eval_shingles[j])
        if sim >= jaccard:
            found[j].append(("jaccard", f"{sim:.2f}"))
    same: dict[int, list[str]] = defaultdict(list)
    for h, rel in t.files.items():
        for j in file_index.get(h, ()):
            same[j].append(rel if rel == evals[j].files[h] else f"{rel} = {evals[j].files[h]}")
    for j, rels in same.items():
        found[j].append(("file", ", ".join(sorted(rels))))
    return [Overlap(train=str(t.path), eval=str(evals[j].path), kind=kind, evidence=ev)
            for j in sorted(found) for kind, ev in found[j]]


def check_dirs(train_dirs: Sequence[Path], eval_roots: Sequence[Path], *, jaccard: float = DEFAULT_JACCARD,
               common: int = DEFAULT_COMMON) -> list[Overlap]:
    """`find_overlaps` of training task directories against every task under the evaluation roots."""
    if not 0 < jaccard <= 1:
        raise ValueError(f"jaccard: expected a threshold in (0, 1], got {jaccard}")
    if common < 2:
        raise ValueError(f"common: expected >= 2 (a key one task holds is never boilerplate), got {common}")
    evals = [read_task(d) for root in eval_roots for d in find_task_dirs(root)]
    return find_overlaps([read_task(d) for d in train_dirs], evals, jaccard=jaccard, common=common)


def format_table(overlaps: list[Overlap], *, num_train: int, num_eval: int) -> str:
    rows = [(Path(o.train).name, Path(o.eval).name, o.kind, _clip(o.evidence)) for o in overlaps]
    head = ("train task", "eval task", "kind", "shared")
    widths = [max([len(head[i])] + [len(r[i]) for r in rows]) for i in range(3)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths + [0])).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths + [0])).rstrip() for r in rows]
    num_pairs = len({(o.train, o.eval) for o in overlaps})
    lines += ["", f"{num_pairs} contaminated pairs ({len({o.train for o in overlaps})} of {num_train} training "
                  f"tasks) against {num_eval} evaluation tasks"]
    return "\n".join(lines)


def _clip(text: str, n: int = 100) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m sandbox.decontaminate", description=__doc__.split("\n\n")[0],
                    epilog="example: python -m sandbox.decontaminate runs/r1/tasks --against /data/tb2 /data/tb1")
    parser.add_argument("train_dir", type=Path, help="a directory of training tasks (or one task)")
    parser.add_argument("--against", type=Path, nargs="+", required=True, metavar="EVAL_DIR",
                        help="directories of evaluation tasks (or single tasks)")
    parser.add_argument("--jaccard", type=float, default=DEFAULT_JACCARD,
                        help=f"5-gram Jaccard similarity that makes a pair (default {DEFAULT_JACCARD})")
    parser.add_argument("--common", type=int, default=DEFAULT_COMMON,
                        help=f"a file or span this many evaluation tasks (or training families) share is "
                             f"boilerplate (default {DEFAULT_COMMON})")
    args = parser.parse_args(argv)
    try:
        train_dirs = find_task_dirs(args.train_dir)
        overlaps = check_dirs(train_dirs, args.against, jaccard=args.jaccard, common=args.common)
        num_eval = sum(len(find_task_dirs(root)) for root in args.against)
    except (ValueError, OSError) as e:
        parser.error(str(e))
    print(format_table(overlaps, num_train=len(train_dirs), num_eval=num_eval))
    return 1 if overlaps else 0


if __name__ == "__main__":
    sys.exit(main())
