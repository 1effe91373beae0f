"""``benchmarks/results/index.json`` lists every kept run, and what it says of the docs is true."""

from __future__ import annotations

import re

from benchmarks import results_index


def test_the_index_lists_every_run_and_every_citation_of_a_path():
    assert results_index.problems(strict=False) == []


def test_a_run_named_after_a_commit_records_that_commit():
    for entry in results_index.load()["entries"]:
        named = re.search(r"-([0-9a-f]{7})(?:-[a-z0-9]+)?(?:/|\.txt$)", entry["path"])
        if named:
            assert entry["commit"] == named.group(1), entry["path"]


def test_a_missing_run_and_a_stale_citation_are_named():
    index = results_index.load()
    first, *rest = index["entries"]
    stale = dict(first, cited_by=["docs/nowhere.md"])
    found = results_index.problems({"entries": [stale, *rest[1:]]}, strict=False)
    assert any(p.startswith(f"{rest[0]['path']}: in results/ but not") for p in found), found
    assert any(p.startswith(f"{first['path']}: cited by ") for p in found), found
    strict = results_index.problems({"entries": [stale, *rest]})
    cited = first["cited_by"]
    assert (
        f"{first['path']}: cited_by is ['docs/nowhere.md'], the docs give {cited} (--update)"
        in strict
    )
