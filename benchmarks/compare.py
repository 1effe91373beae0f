"""Compare two suite result files: per benchmark, case and mode, new median / old median.

::

    python -m benchmarks compare OLD.json NEW.json                  # ratios, flags
    python -m benchmarks compare OLD.json NEW.json --threshold 1.2 --fail-on-regression

A ratio above 1 is slower. A row is a **regression** when its ratio is above ``--threshold``
(default 1.1) *and* the difference of the medians is larger than the noise, the sum of the
two runs' spreads (inter-quartile ranges of their samples): a slowdown within the runs' own
scatter is printed as ``noise``, not flagged. A check that was ``ok`` and is no longer
(``failed``: a wrong result, however fast; ``error``) is a regression whatever the time.
``faster`` is the same test the other way. Rows in one file only are listed as ``new`` or
``gone``. The exit status is 0, unless ``--fail-on-regression`` is given and a regression
was found (then 1).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks.suite import FORMAT

Key = tuple[str, str, str]


def load(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: format {data.get('format')!r} is not {FORMAT!r}")
    return data


def index(data: dict) -> dict[Key, dict]:
    return {(r["benchmark"], r["case"], r["mode"]): r for r in data["results"]}


def verdict(old: dict | None, new: dict | None, threshold: float) -> tuple[float | None, str]:
    """``(ratio new/old, verdict)``; the verdict is ``REGRESSION``, ``faster``, ``noise``,
    ``""`` (within the threshold), ``new``, ``gone``, ``fixed`` or both checks' names."""
    if old is None or new is None:
        return None, "new" if old is None else "gone"
    if old["check"] == "ok" and new["check"] in ("failed", "error"):
        return None, f"REGRESSION (check {new['check']})"
    if old["check"] != "ok" or new["check"] != "ok":
        return None, "fixed" if new["check"] == "ok" else f"{old['check']} -> {new['check']}"
    a, b = old.get("median"), new.get("median")
    if not a or b is None:
        return None, "no median"
    ratio = b / a
    noise = (old.get("spread") or 0.0) + (new.get("spread") or 0.0)
    if ratio > threshold:
        return ratio, "REGRESSION" if b - a > noise else "noise"
    if ratio < 1 / threshold:
        return ratio, "faster" if a - b > noise else "noise"
    return ratio, ""


def compare(old: dict, new: dict, threshold: float) -> list[dict]:
    """One line per key of either file, in the old file's order, then the new keys."""
    a, b = index(old), index(new)
    out = []
    for key in [*a, *(k for k in b if k not in a)]:
        ratio, flag = verdict(a.get(key), b.get(key), threshold)
        out.append(
            {
                "key": key,
                "old": (a.get(key) or {}).get("median"),
                "new": (b.get(key) or {}).get("median"),
                "noise": sum((x.get(key) or {}).get("spread") or 0.0 for x in (a, b)),
                "ratio": ratio,
                "verdict": flag,
            }
        )
    return out


def _num(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _describe(data: dict) -> str:
    m = data.get("machine", {})
    return (
        f"{m.get('name')} ({m.get('device', '?')}), commit {data.get('commit')}"
        + (" (dirty)" if data.get("dirty") else "")
        + f", source {data.get('source_digest')}, backend {data.get('backend')}"
        + (", quick" if data.get("quick") else "")
    )


def render(lines: list[dict], old: dict, new: dict, threshold: float) -> str:
    out = [
        f"old: {_describe(old)}",
        f"new: {_describe(new)}",
        f"ratio = new median / old median (> 1: slower); REGRESSION: ratio > {threshold:g} and "
        "the medians differ by more than the noise (old spread + new spread, IQRs), or a check "
        "no longer ok",
    ]
    for what in ("machine", "backend", "quick"):
        x, y = (old.get(what), new.get(what))
        if what == "machine":
            x, y = (x or {}).get("name"), (y or {}).get("name")
        if x != y:
            out.append(f"note: the {what} differs ({x} against {y}): ratios mix it in")
    if old.get("quick") or new.get("quick"):
        out.append(
            "note: a --quick run: toy sizes and 2 samples, made to check that each benchmark "
            "runs and is right; its times are not measurements"
        )
    out.append(
        f"{'benchmark':<10} {'case':<30} {'mode':<34} {'old ms':>9} {'new ms':>9} "
        f"{'noise':>7} {'ratio':>6}  verdict"
    )
    for line in lines:
        bench, case, mode = line["key"]
        out.append(
            f"{bench:<10} {case:<30} {mode:<34} {_num(line['old'], '.2f'):>9} "
            f"{_num(line['new'], '.2f'):>9} {_num(line['noise'], '.2f'):>7} "
            f"{_num(line['ratio'], '.2f'):>6}  {line['verdict']}"
        )
    out.append("")
    out.append("geometric mean of the ratios, per benchmark (rows ok in both):")
    for bench in dict.fromkeys(line["key"][0] for line in lines):
        ratios = [x["ratio"] for x in lines if x["key"][0] == bench and x["ratio"]]
        mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else None
        out.append(f"  {bench:<10} {_num(mean, '.3f'):>6} over {len(ratios)} rows")
    counts = {
        v: sum(1 for x in lines if x["verdict"].startswith(v))
        for v in ("REGRESSION", "faster", "noise", "new", "gone")
    }
    out.append(
        f"{len(lines)} rows: {counts['REGRESSION']} regressions, {counts['faster']} faster, "
        f"{counts['noise']} beyond the threshold within noise, {counts['new']} new, "
        f"{counts['gone']} gone"
    )
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    old, new = load(args.old), load(args.new)
    lines = compare(old, new, args.threshold)
    print(render(lines, old, new, args.threshold))
    regressions = [x for x in lines if x["verdict"].startswith("REGRESSION")]
    return 1 if regressions and args.fail_on_regression else 0


def add_compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("old", help="the baseline's suite JSON")
    p.add_argument("new", help="the suite JSON to judge")
    p.add_argument("--threshold", type=float, default=1.1, help="ratio beyond which to flag")
    p.add_argument("--fail-on-regression", action="store_true", help="exit 1 on a regression")
