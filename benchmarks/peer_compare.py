"""Compare the JUnit XML of ``peer_suites.sh`` runs: plain Dask against the plugin's variants.

``peer_compare.py new DIR SLUG VARIANT`` prints the node ids of the tests that pass in the
``plain`` run and fail in ``VARIANT`` (for a rerun); ``peer_compare.py report DIR`` prints, per
module, passed/failed/skipped of each variant, the new failures with their first error line
(and, where a rerun was made, whether it failed again), and each run's wall time.
"""

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path

BASELINE = "plain"
VARIANTS = ("plain", "off", "on")


def outcomes(path: Path) -> dict[str, tuple[str, str]]:
    """Node id -> (outcome, first line of the failure message) from an xunit1 JUnit XML file."""
    results: dict[str, tuple[str, str]] = {}
    for case in ET.parse(path).iter("testcase"):
        module = case.get("file", "").removesuffix(".py").replace("/", ".")
        cls = case.get("classname", "").removeprefix(module).lstrip(".")
        nodeid = "::".join(p for p in (case.get("file", ""), cls, case.get("name", "")) if p)
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                message = message or (child.get("message") or child.tag).strip().split("\n")[0]
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        if results.get(nodeid, ("passed",))[0] != "failed":
            results[nodeid] = (outcome, message)
    return results


def new_failures(runs: dict[str, dict], variant: str) -> dict[str, str]:
    """Tests that pass in the baseline and fail in ``variant``: node id -> first error line."""
    base, other = runs[BASELINE], runs[variant]
    return {
        nodeid: other[nodeid][1]
        for nodeid, (outcome, _) in base.items()
        if outcome == "passed" and other.get(nodeid, ("missing",))[0] == "failed"
    }


def load(directory: Path, slug: str) -> dict[str, dict]:
    """The runs of one module that exist: variant -> outcomes."""
    return {
        v: outcomes(directory / f"{slug}.{v}.xml")
        for v in VARIANTS
        if (directory / f"{slug}.{v}.xml").exists()
    }


def counts(results: dict[str, tuple[str, str]]) -> str:
    """``passed/failed/skipped`` (errors count as failed)."""
    kinds = [r[0] for r in results.values()]
    return "/".join(str(kinds.count(k)) for k in ("passed", "failed", "skipped"))


def report(directory: Path) -> None:
    """Print the difference table, the new failures and the wall times."""
    modules = [line.split("\t") for line in (directory / "modules.tsv").read_text().splitlines()]
    details = []
    for slug, module in modules:
        runs = load(directory, slug)
        if BASELINE not in runs:
            print(f"{module}: no {BASELINE} run")
            continue
        cells = [f"{counts(r)} {v}" for v, r in runs.items()]
        for variant in runs:
            if variant == BASELINE:
                continue
            new = new_failures(runs, variant)
            missing = len(runs[BASELINE].keys() - runs[variant].keys())
            cells.append(f"{len(new)} new failures {variant}")
            if missing:
                cells.append(f"{missing} tests missing from {variant}")
            rerun_path = directory / f"{slug}.{variant}.rerun.xml"
            rerun = outcomes(rerun_path) if rerun_path.exists() else {}
            for nodeid, message in new.items():
                again = {"failed": " [failed again]", "passed": " [passed on rerun]"}
                note = again.get(rerun.get(nodeid, ("",))[0], "")
                details.append(f"  {variant}: {nodeid}{note}\n      {message[:200]}")
        print(f"{module}: " + ", ".join(cells))
    if details:
        print("\nnew failures (passed plain):")
        print("\n".join(details))
    times = directory / "times.tsv"
    if times.exists():
        print("\nwall time (s), exit status:")
        for line in times.read_text().splitlines():
            slug, variant, seconds, rc = line.split("\t")
            print(f"  {slug} {variant}: {seconds} s, rc {rc}")


def main() -> None:
    """Command line: ``new DIR SLUG VARIANT`` or ``report DIR``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="node ids of the new failures of one run")
    new.add_argument("directory", type=Path)
    new.add_argument("slug")
    new.add_argument("variant", choices=VARIANTS[1:])
    sub.add_parser("report", help="the difference table").add_argument("directory", type=Path)
    args = parser.parse_args()
    if args.command == "new":
        runs = load(args.directory, args.slug)
        for nodeid in new_failures(runs, args.variant):
            print(nodeid)
    else:
        report(args.directory)


if __name__ == "__main__":
    main()
