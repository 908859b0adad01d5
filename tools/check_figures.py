#!/usr/bin/env python3
"""Check that every measured figure in README.md and docs/ traces to a committed result file.

A doc section (the text under one heading) that states measured figures cites the result files they come from
(paths under `benchmarks/results/`, a folder standing for every file in it). The checker fails when:

- a cited path does not exist;
- a cited result has no provenance: `benchmarks/results/SOURCES.md` names the command, commit, machine and date
  of every result file or folder (a row per file or folder; the commit a hash of this repository);
- a figure stated in a section is found in none of the files that section cites, or the section cites none.

What counts as a figure: in prose, a number with a unit of measurement (ms, s, GiB, MiB, TFLOP/s, tokens/s, MHz,
%, "x" for a ratio, B/param), in a table cell too; in a table whose column heading or row label names a measure
(a unit above but "x", "loss", "error", "ratio", "bytes", "peak"), every number with a decimal point or a thousands
separator in the cells after the first. Numbers after "target", "<=", ">=", "within" (what was asked, not
measured) and inside code blocks are not figures. A figure is found when a number in a cited file rounds to it
at the precision written (a percentage also as a fraction; bytes also as GiB/MiB).

    python tools/check_figures.py            # exit 1 and one line per problem
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"

NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
UNIT = r"(?:ms|s|GiB|MiB|GB|MB|TFLOP/s|TFLOP|tokens/s|MHz|%|x(?!\s?[\dA-Z])|B/param|bytes per parameter)"
PROSE_FIGURE = re.compile(rf"(?<![\w.\-/])(?:(?P<low>{NUMBER})\s?-\s?)?(?P<value>{NUMBER})\s?{UNIT}(?![\w/])")
TABLE_NUMBER = re.compile(rf"(?<![\w.])(?:{NUMBER})(?![\w])")
MEASURE = re.compile(
    r"\b(ms|s|GiB|MiB|GB|MB|TFLOP/s|TFLOP|tokens/s|MHz|loss|losses|error|ratio|bytes|peak)\b|%|B/param",
    re.IGNORECASE)
NOT_MEASURED = re.compile(r"(target|<=|>=|at least|at most|under|within)\s*$", re.IGNORECASE)
CITATION = re.compile(rf"{RESULTS}/[\w.\-/]+")
HEX = re.compile(r"^[0-9a-f]{7,40}$")


def sections(text: str):
    """(heading, lines) per section, code blocks dropped."""
    heading, lines, fenced = "(top)", [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            continue
        if line.startswith("#"):
            yield heading, lines
            heading, lines = line.lstrip("# ").strip(), []
        else:
            lines.append(line)
    yield heading, lines


def figures(lines):
    """(figure text, line) for every figure in these lines."""
    header = None
    for line in lines:
        if not line.startswith("|"):
            header = None
            yield from _prose_figures(line, line)
            continue
        cells = line.strip().strip("|").split("|")
        if set("".join(cells)) <= set("-: "):
            continue
        if header is None:
            header = cells
            continue
        for column, cell in enumerate(cells[1:], start=1):
            yield from _prose_figures(cell, line)
            heading = header[column] if column < len(header) else ""
            if not (MEASURE.search(heading) or MEASURE.search(cells[0])) or PROSE_FIGURE.search(cell):
                continue
            for match in TABLE_NUMBER.finditer(cell):
                text = match.group(0)
                if ("." in text or "," in text) and not NOT_MEASURED.search(cell[:match.start()]):
                    yield text, line


def _prose_figures(text, line):
    for match in PROSE_FIGURE.finditer(text):
        if NOT_MEASURED.search(text[max(0, match.start() - 12):match.start()]):
            continue
        for key in ("low", "value"):
            if match.group(key):
                yield match.group(key), line


def numbers_in(path: Path) -> list[float]:
    """Every number a result file holds (text or JSON)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    found = []
    for file in files:
        if file.suffix in (".png", ".pt"):
            continue
        text = file.read_text(errors="replace")
        found += [float(n.replace(",", "")) for n in re.findall(rf"-?(?:{NUMBER})(?:e[-+]?\d+)?", text)
                  if _finite(n)]
    return found


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text.replace(",", "")))
    except ValueError:
        return False


def matches(figure: str, candidates: list[float], percent: bool) -> bool:
    value = float(figure.replace(",", ""))
    decimals = len(figure.split(".")[1]) if "." in figure else 0
    half = 0.5 * 10 ** -decimals + 1e-12
    scales = [1.0, 2**-30, 2**-20, 1e3, 1e-3] + ([100.0] if percent else [])
    return any(abs(c * s - value) <= half for c in candidates for s in scales)


def provenance(sources: Path) -> dict[str, dict[str, str]]:
    """SOURCES.md's rows: path -> {command, commit, machine, date}."""
    rows = {}
    if not sources.exists():
        return rows
    for line in sources.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith(RESULTS):
            rows[cells[0].rstrip("/")] = dict(zip(("command", "commit", "machine", "date"), cells[1:]))
    return rows


def source_of(cited: str, rows: dict) -> dict | None:
    path = cited.rstrip("/")
    while path.startswith(RESULTS):
        if path in rows:
            return rows[path]
        path = path.rsplit("/", 1)[0]
    return None


def check(root: Path = ROOT) -> list[str]:
    """Every problem with the figures of root's README.md and docs/*.md, one line each."""
    sources = root / RESULTS / "SOURCES.md"
    index = sources.relative_to(root)
    problems, rows, cache = [], provenance(sources), {}
    for path, row in rows.items():
        if not (root / path).exists():
            problems.append(f"{index}: {path} does not exist")
        if not HEX.match(row["commit"].split()[0] if row["commit"] else ""):
            problems.append(f"{index}: {path}: commit {row['commit']!r} is not a hash")
        if not all(row.values()):
            problems.append(f"{index}: {path}: command, commit, machine and date all needed")
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        if not doc.exists():
            continue
        name = doc.relative_to(root)
        for heading, lines in sections(doc.read_text()):
            cited = sorted({c.rstrip(".,;:)/") for line in lines for c in CITATION.findall(line)})
            for path in cited:
                if not (root / path).exists():
                    problems.append(f"{name} [{heading}]: {path} does not exist")
                elif source_of(path, rows) is None:
                    problems.append(f"{name} [{heading}]: {path} has no row in {index}")
            candidates = None
            for figure, line in figures(lines):
                if candidates is None:
                    candidates = []
                    for path in cited:
                        if (root / path).exists():
                            candidates += cache.setdefault(path, numbers_in(root / path))
                if not cited:
                    problems.append(f"{name} [{heading}]: {figure} cites no result file: {line.strip()[:100]}")
                elif not matches(figure, candidates, percent="%" in line):
                    problems.append(f"{name} [{heading}]: {figure} is in none of {', '.join(cited)}: "
                                    f"{line.strip()[:100]}")
    return problems


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} problem(s) in the figures of README.md and docs/")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
