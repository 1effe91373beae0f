"""``benchmarks/results/index.json``: the kept runs, machine-readable, and the check of it.

Each entry is one run's directory, or one file of the grab-bag folders ``h200-misc/`` and
``cpu-misc/``: ``path`` (under ``benchmarks/results/``), ``commit`` (of the tree that ran;
``commit_note`` as ``results/README.md`` gives it), ``machine``, ``command``, ``what`` (what it
measured), and two fields computed from the docs (``README.md``, ``docs/*.md``,
``docs/measurements/*.md``, ``benchmarks/README.md``): ``cited_by``, the docs that name the
path (or a glob matching it, such as ``h200-copy-*``), and ``commit_named_in``, the docs that
name its commit, where numbers of that run may be quoted without the path. A run with neither
is not cited: it may go.

::

    python -m benchmarks.results_index            # check: exit 1, naming each problem
    python -m benchmarks.results_index --update   # recompute cited_by and commit_named_in
    python -m benchmarks.results_index --uncited  # the entries no doc cites

The check: every run under ``results/`` has an entry, every entry's path exists, every
``results/...`` path a doc names exists, and the computed fields are those of the docs
(``tests/test_benchmarks_index.py`` checks all but the last, of which only that no doc cites a
path the entry does not record). A new run: add its entry by hand, then ``--update``.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import re
import sys

from benchmarks.report import REPO

RESULTS = REPO / "benchmarks" / "results"
INDEX = RESULTS / "index.json"
#: Folders of single files from many calls: one entry per file.
MISC = ("h200-misc", "cpu-misc")
#: Suite runs (``python -m benchmarks run``): self-describing files keyed by machine and commit.
SUITE = "suite"
#: Where a result may be cited.
DOC_GLOBS = ("README.md", "docs/*.md", "docs/measurements/*.md", "benchmarks/README.md")
FIELDS = ("path", "commit", "commit_note", "machine", "command", "what")
COMPUTED = ("cited_by", "commit_named_in")


def docs() -> dict[str, str]:
    return {
        p.relative_to(REPO).as_posix(): p.read_text()
        for pattern in DOC_GLOBS
        for p in sorted(REPO.glob(pattern))
    }


def listed_paths() -> list[str]:
    """What needs an entry: each run directory, and each file of the misc folders."""
    out = []
    for p in sorted(RESULTS.iterdir()):
        if p.is_dir() and p.name in MISC:
            out += [f"{p.name}/{f.name}" for f in sorted(p.iterdir()) if f.is_file()]
        elif p.is_dir() and p.name != SUITE:
            out.append(f"{p.name}/")
    return out


@functools.cache
def _globs(text: str) -> tuple[str, ...]:
    """The run-name globs a doc names, such as ``h200-copy-*``."""
    return tuple(re.findall(r"(?<![\w-])((?:h200|sim|cpu)-[\w-]*\*)", text))


def citations(entry: dict, texts: dict[str, str]) -> dict[str, list[str]]:
    """``cited_by`` and ``commit_named_in`` of ``entry`` in ``texts``."""
    name = entry["path"].rstrip("/")
    exact = re.compile(r"(?<![\w.-])" + re.escape(name) + r"(?![\w-])")
    cited = []
    for doc, text in texts.items():
        if (
            name in text
            and exact.search(text)
            or any(fnmatch.fnmatch(name, g) for g in _globs(text))
        ):
            cited.append(doc)
    commit = entry.get("commit")
    named = [
        doc
        for doc, text in texts.items()
        if commit and commit in text and re.search(rf"\b{commit}\b", text)
    ]
    return {"cited_by": cited, "commit_named_in": named}


def load() -> dict:
    return json.loads(INDEX.read_text())


def problems(index: dict | None = None, strict: bool = True) -> list[str]:
    """What is wrong with ``index``. Not ``strict``: only what could lose a cited run (a run
    missing, a path gone, a doc's citation of a path not recorded); ``strict`` also names every
    computed field that differs from the docs (a citation dropped, a commit named anew)."""
    index = load() if index is None else index
    texts = docs()
    out = []
    entries = {e["path"]: e for e in index["entries"]}
    for path in listed_paths():
        if path not in entries:
            out.append(f"{path}: in results/ but not in index.json")
    for path, e in entries.items():
        if not (RESULTS / path).exists():
            out.append(f"{path}: in index.json but not in results/")
        missing = [f for f in FIELDS if f not in e]
        if missing:
            out.append(f"{path}: fields {missing} missing")
        now = citations(e, texts)
        for key in COMPUTED:
            recorded = e.get(key) or []
            if strict and recorded != now[key]:
                out.append(f"{path}: {key} is {recorded}, the docs give {now[key]} (--update)")
            elif key == "cited_by" and set(now[key]) - set(recorded):
                out.append(f"{path}: cited by {now[key]}, recorded {recorded} (--update)")
    for doc, text in texts.items():
        for cited in re.findall(r"benchmarks/results/([\w.-]+(?:/[\w.*-]+)*)", text):
            if cited.split("/")[0] == SUITE or "*" in cited:
                continue  # the suite's default --out, made by its first run; a glob
            if not (RESULTS / cited.rstrip(".")).exists():
                out.append(f"{doc} cites benchmarks/results/{cited}, which does not exist")
    return out


def update() -> int:
    index = load()
    texts = docs()
    for e in index["entries"]:
        e.update(citations(e, texts))
    INDEX.write_text(json.dumps(index, indent=1, ensure_ascii=False) + "\n")
    return 0


def uncited(index: dict | None = None) -> list[dict]:
    index = load() if index is None else index
    return [e for e in index["entries"] if not e["cited_by"] and not e["commit_named_in"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.results_index", description=__doc__.split("\n")[0]
    )
    p.add_argument("--update", action="store_true", help="recompute cited_by, commit_named_in")
    p.add_argument("--uncited", action="store_true", help="list the entries no doc cites")
    args = p.parse_args(argv)
    if args.update:
        update()
    if args.uncited:
        for e in uncited():
            print(f"{e['path']:<48} {e['commit'] or '-':<8} {e['what']}")
        return 0
    found = problems()
    for line in found:
        print(line)
    print(f"{len(load()['entries'])} entries, {len(found)} problems")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
