"""The docs agree with the repository.

* Every ``docs/**.md`` the code, README.md or docs/ names exists, and every section it cites (``§4.5``,
  ``section 2.1``, ``docs/design/algorithms.md 2.2``) is a numbered heading of that document.
* A ``§`` citation in a source file is unambiguous: the file names the document it cites.
* Every relative link in README.md and docs/**.md resolves, anchors included (GitHub's heading slugs).
* Every repository path, every ``python -m`` module and every dotted ``jaxrl.`` name that README.md and docs/
  name exists (dotted names are imported).
* docs/ is laid out as its index says: every page sits in guides/ (how to), reference/ (look up) or design/ (for
  contributors), every file and folder name is lowercase kebab-case (``my-page.md``, not ``my_page.md``;
  docs/README.md, the index, excepted), and docs/README.md links every page.
* The config tables of docs/reference/config.md list every key of the config files with its value there.

After changing a config, refresh the default column of docs/reference/config.md (meanings are kept; a new key gets
an empty meaning, which the test then asks you to fill in):

    python tests/test_docs.py --write
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import pytest

ROOT = Path(__file__).resolve().parents[1]
CODE_DIRS = ("jaxrl", "launchers", "configs", "benchmarks", "tests")
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".sh"}
# This file names documents and paths that do not exist on purpose (the checkers' bad inputs).
SELF = Path(__file__).resolve()

# docs/X.md, optionally followed by the sections it cites: "§4.1, §4.5", "§6-7", "section 2.1", " 2.2".
_CITATION = re.compile(
    r"(?<![\w/.-])(docs/[A-Za-z0-9_./-]+?\.md)[`'\"]*"
    r"((?:\s*,?\s*(?:§|section\s+)\s*\d+(?:\.\d+)*(?:\s*-\s*\d+(?:\.\d+)*)?|\s+\d+\.\d+(?:\.\d+)*)*)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_NUMBERED = re.compile(r"^(\d+(?:\.\d+)*)\.?(?:\s|$)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REPO_PATH = re.compile(r"(?<![\w/.$-])((?:jaxrl|launchers|configs|benchmarks|tests|docs)/[A-Za-z0-9_./-]*[A-Za-z0-9_])")
_MODULE = re.compile(r"python3?\s+-m\s+([A-Za-z_][\w.]*)")
_OUR_PACKAGES = ("jaxrl", "launchers", "configs", "benchmarks", "tests")
_DOTTED = re.compile(r"(?<![\w/.-])(jaxrl(?:\.[A-Za-z_]\w*)+)(?![\w/])")

# Source files that cite "docs §N" without naming the document. Empty this set as the files are fixed; the test
# fails both on a new such file and on a listed file that no longer needs to be listed.
BARE_SECTION_CITATIONS: set = set()


# ------------------------------------------------------------------------------------------------ files


def code_files(root: Path = ROOT) -> list[Path]:
    """Text files under the code folders, plus the top-level build files."""
    out = [p for d in CODE_DIRS for p in sorted((root / d).rglob("*"))
           if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    out += [p for p in (root / "Makefile", root / "pyproject.toml") if p.is_file()]
    return [p for p in out if p.resolve() != SELF]


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md"] + sorted((root / "docs").rglob("*.md"))


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def prose_lines(text: str) -> Iterable[tuple[int, str]]:
    """(line number, line) of Markdown outside fenced code blocks, inline code removed."""
    fenced = False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield i, re.sub(r"`[^`]*`", "", line)


# ------------------------------------------------------------------------------------------ headings


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(text: str) -> list[str]:
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := _HEADING.match(line)):
            out.append(m.group(2))
    return out


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in headings(text):
        slug = github_slug(h)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def sections(text: str) -> set[str]:
    """Section numbers of the numbered headings ("## 2. Forward" -> "2", "### 2.4 Rotary" -> "2.4")."""
    return {m.group(1) for h in headings(text) if (m := _NUMBERED.match(h))}


# ------------------------------------------------------------------------------------------- checkers


def citations(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, docs/X.md, [section numbers]) for every document the text names."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        for m in _CITATION.finditer(line):
            out.append((i, m.group(1), re.findall(r"\d+(?:\.\d+)*", m.group(2))))
    return out


def citation_problems(files: Sequence[Path], root: Path) -> list[str]:
    """'file:line: ...' for each cited document that is missing and each cited section it lacks."""
    problems, cache = [], {}
    for f in files:
        for line, doc, secs in citations(f.read_text(encoding="utf-8", errors="replace")):
            target = root / doc
            where = f"{_rel(f, root)}:{line}"
            if not target.is_file():
                problems.append(f"{where}: {doc} does not exist")
                continue
            if doc not in cache:
                cache[doc] = sections(target.read_text(encoding="utf-8"))
            problems += [f"{where}: {doc} has no section {s}" for s in secs if s not in cache[doc]]
    return problems


def bare_section_files(files: Sequence[Path], root: Path) -> dict[str, list[int]]:
    """{file: [lines]} of files that cite a '§' section but name no docs/*.md anywhere."""
    out = {}
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if "§" in text and not _CITATION.search(text):
            out[_rel(f, root)] = [i for i, line in enumerate(text.splitlines(), 1) if "§" in line]
    return out


def link_problems(md_files: Sequence[Path], root: Path) -> list[str]:
    """'file:line: ...' for each relative link whose file or anchor does not exist."""
    problems = []
    for f in md_files:
        text = f.read_text(encoding="utf-8")
        for line, prose in prose_lines(text):
            for target in _LINK.findall(prose):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, anchor = target.partition("#")
                dest = (f.parent / path).resolve() if path else f
                where = f"{_rel(f, root)}:{line}"
                if not dest.exists():
                    problems.append(f"{where}: link target {target} does not exist")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
                    problems.append(f"{where}: {path or f.name} has no heading with anchor #{anchor}")
    return problems


def _placeholder(parts: Sequence[str]) -> bool:
    """A name written in capitals stands for any name: launchers.NAME, configs/X.py."""
    return any(re.fullmatch(r"[A-Z][A-Z_]*", p.split(".")[0]) for p in parts)


def mention_problems(md_files: Sequence[Path], root: Path) -> list[str]:
    """'file:line: ...' for repository paths and `python -m` modules of ours that the docs name but do not exist."""
    problems = []
    for f in md_files:
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            where = f"{_rel(f, root)}:{i}"
            for m in _REPO_PATH.finditer(line):
                path = m.group(1)
                if line[m.end():m.end() + 1] in ("*", "<", "{") or _placeholder(path.split("/")):
                    continue  # a pattern (benchmarks/bench_*.py) or a placeholder (configs/X.py)
                if not (root / path).exists():
                    problems.append(f"{where}: {path} does not exist")
            for module in _MODULE.findall(line):
                if module.split(".")[0] not in _OUR_PACKAGES or _placeholder(module.split(".")):
                    continue
                base = root.joinpath(*module.split("."))
                if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
                        or (base / "__main__.py").is_file()):
                    problems.append(f"{where}: python -m {module}: no such module")
    return problems


def resolve_dotted(name: str) -> str | None:
    """None when `name` (jaxrl.pkg.module.attr...) imports and its attributes exist, else what is missing."""
    import importlib
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
            break
        except ModuleNotFoundError as e:
            if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
                raise  # a dependency of the module is missing, not the module
    for j, attr in enumerate(parts[i:], i):
        if not hasattr(obj, attr):
            return f"{'.'.join(parts[:j])} has no {attr}"
        obj = getattr(obj, attr)
    return None


def dotted_name_problems(md_files: Sequence[Path], root: Path) -> list[str]:
    problems = []
    for f in md_files:
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for name in _DOTTED.findall(line):
                if (why := resolve_dotted(name)) is not None:
                    problems.append(f"{_rel(f, root)}:{i}: {name}: {why}")
    return problems


# ------------------------------------------------------------------------------------------- layout

# docs/ as Levanter's docs: how-to guides, look-up reference, design notes for contributors; docs/README.md indexes.
DOC_SECTIONS = ("guides", "reference", "design")
_KEBAB = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")


def layout_problems(root: Path) -> list[str]:
    """'docs/...: ...' for each file or folder under docs/ whose name is not lowercase kebab-case, each page outside
    the sections, and each non-Markdown file."""
    docs, problems = root / "docs", []
    for path in sorted(docs.rglob("*")):
        rel = _rel(path, root)
        if "__pycache__" in path.parts or path == docs / "README.md":
            continue
        stem, _, ext = path.name.partition(".")
        if not _KEBAB.fullmatch(stem) or (path.is_file() and ext != "md"):
            what = "folder" if path.is_dir() else "page"
            problems.append(f"{rel}: not a kebab-case {what} name (a-z, 0-9 and '-'; pages end in .md: my-page.md)")
        if path.is_file() and path.relative_to(docs).parts[0] not in DOC_SECTIONS:
            problems.append(f"{rel}: a page belongs in docs/{{{','.join(DOC_SECTIONS)}}}/")
    return problems


def index_problems(root: Path) -> list[str]:
    """'docs/...: ...' for each page under docs/ that docs/README.md does not link."""
    index = root / "docs" / "README.md"
    linked = set()
    for _, prose in prose_lines(index.read_text(encoding="utf-8")):
        for target in _LINK.findall(prose):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                linked.add((index.parent / target.partition("#")[0]).resolve())
    return [f"{_rel(p, root)}: not linked from docs/README.md" for p in sorted((root / "docs").rglob("*.md"))
            if p != index and p.resolve() not in linked]


# --------------------------------------------------------------------------------------- config tables

# docs/reference/config.md holds one table after each marker `<!-- config-table: NAME -->`. NAME -> (config module,
# the keys the table lists: all (None) or those under these prefixes, and whether it also lists the keys outside
# data.* whose value differs from configs/base.py).
CONFIG_DOC = ROOT / "docs/reference/config.md"
CONFIG_TABLES = {
    "base": ("configs.base", None, False),
    "dpo": ("configs.dpo", ("run", "start", "dpo.", "data."), True),
    "grpo": ("configs.grpo", ("run", "start", "probe", "grpo."), True),
    "online-data": ("configs.grpo", ("data.", "reward."), False),
    "ppo": ("configs.ppo", ("run", "start", "ppo."), True),
    "distill": ("configs.distill", ("run", "start", "distill."), True),
}
# Blocks that one table documents for two families: they must agree.
SHARED_BLOCKS = (("configs.grpo", "configs.ppo", ("data.", "reward.")),
                 ("configs.grpo", "configs.distill", ("data.", "reward.")))
_MARKER = re.compile(r"^<!--\s*config-table:\s*([\w-]+)\s*-->\s*$")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def flatten(config, prefix: str = "") -> dict:
    """{dotted key: value} of a ConfigDict; an empty block is one value ({})."""
    out = {}
    for key, value in config.items():
        if hasattr(value, "items") and len(value):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def format_value(value) -> str:
    if isinstance(value, str):
        return value if value else '""'
    if hasattr(value, "to_dict"):
        value = value.to_dict()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {format_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _load_config(module: str) -> dict:
    import importlib
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("JAXRL_QWEN35_")}
    try:  # model_path comes from these variables; the documented value is the one without them
        return flatten(importlib.import_module(module).get_config())
    finally:
        os.environ.update(saved)


def expected_tables() -> dict[str, dict[str, str]]:
    """{table: {key: formatted value}} as the config files give them today."""
    base = _load_config("configs.base")
    out = {}
    for name, (module, prefixes, changed) in CONFIG_TABLES.items():
        flat = _load_config(module)
        if prefixes is None:
            keys = list(flat)
        else:
            keys = [k for k in flat if k.startswith(prefixes)
                    or (changed and k in base and flat[k] != base[k] and not k.startswith("data."))]
        out[name] = {k: format_value(flat[k]) for k in keys}
    return out


def parse_tables(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """{table: [(key, value, meaning), ...]} of the marked tables of a Markdown text."""
    out, current, lines = {}, None, text.splitlines()
    for i, line in enumerate(lines):
        if m := _MARKER.match(line):
            current = m.group(1)
            out[current] = []
            continue
        if current is None:
            continue
        if not line.startswith("|"):
            if out[current]:
                current = None
            continue
        cells = [c.strip() for c in _CELL_SPLIT.split(line.strip())[1:-1]]
        if len(cells) != 3 or set(cells[0]) <= {"-", ":"} or cells[0] == "key":
            continue
        key, value = cells[0].strip("`"), cells[1]
        value = value[1:-1] if value.startswith("`") and value.endswith("`") else value
        out[current].append((key, value, cells[2]))
    return out


def table_problems(documented: Mapping[str, Sequence[tuple[str, str, str]]],
                   expected: Mapping[str, Mapping[str, str]], where: str = "docs/reference/config.md") -> list[str]:
    problems = []
    for name, keys in expected.items():
        if name not in documented:
            problems.append(f"{where}: no table <!-- config-table: {name} -->")
            continue
        rows = {k: (v, meaning) for k, v, meaning in documented[name]}
        for key, value in keys.items():
            if key not in rows:
                problems.append(f"{where}: table {name}: key {key} (value {value}) is missing")
            elif rows[key][0] != value:
                problems.append(f"{where}: table {name}: {key} is documented as {rows[key][0]}, the config has {value}")
            elif not rows[key][1]:
                problems.append(f"{where}: table {name}: {key} has no meaning")
        problems += [f"{where}: table {name}: {k} is not a key of the config" for k in rows if k not in keys]
    return problems


def write_tables(text: str, expected: Mapping[str, Mapping[str, str]]) -> str:
    """The text with each marked table rebuilt from `expected`, keeping the meanings already written."""
    documented = parse_tables(text)
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        out.append(lines[i])
        m = _MARKER.match(lines[i])
        i += 1
        if not m or m.group(1) not in expected:
            continue
        name = m.group(1)
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        meanings = {k: meaning for k, _, meaning in documented.get(name, [])}
        out += ["| key | value | meaning |", "|---|---|---|"]
        out += [f"| `{k}` | `{v}` | {meanings.get(k, '')} |" for k, v in expected[name].items()]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------- the repository


def test_cited_documents_and_sections_exist():
    problems = citation_problems(code_files() + doc_files(), ROOT)
    assert not problems, "\n".join(problems)


def test_section_signs_name_their_document():
    found = bare_section_files(code_files(), ROOT)
    new = {f: lines for f, lines in found.items() if f not in BARE_SECTION_CITATIONS}
    fixed = sorted(BARE_SECTION_CITATIONS - set(found))
    assert not new, ("these files cite '§' sections without naming the document (write docs/X.md §N): "
                     + "; ".join(f"{f} lines {lines}" for f, lines in new.items()))
    assert not fixed, f"no longer cite bare sections, remove them from BARE_SECTION_CITATIONS: {fixed}"


def test_links_resolve():
    problems = link_problems(doc_files(), ROOT)
    assert not problems, "\n".join(problems)


def test_named_paths_and_modules_exist():
    problems = mention_problems(doc_files(), ROOT)
    assert not problems, "\n".join(problems)


def test_named_python_objects_exist():
    problems = dotted_name_problems(doc_files(), ROOT)
    assert not problems, "\n".join(problems)


def test_docs_layout_and_names():
    problems = layout_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_index_links_every_page():
    problems = index_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_launcher_help_keeps_its_example_commands_as_written():
    """A launcher's --help is its docstring: a backslash that continues an example command must reach the reader,
    so a docstring holding one is raw (r\"\"\"); a plain one joined `rollout --help`'s examples into one line."""
    import ast
    bad = []
    for path in sorted((ROOT / "launchers").glob("*.py")):
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
        doc = tree.body[0] if tree.body and isinstance(tree.body[0], ast.Expr) else None
        if doc is None or not isinstance(getattr(doc, "value", None), ast.Constant):
            continue
        raw = ast.get_source_segment(source, doc.value)
        if "\\\n" in raw and not raw.lstrip().lower().startswith(("r", "rb", "br")):
            bad.append(path.name)
    assert not bad, f"launchers whose docstring continues a command with a backslash but is not raw: {bad}"


def test_config_tables_match_the_configs():
    problems = table_problems(parse_tables(CONFIG_DOC.read_text(encoding="utf-8")), expected_tables())
    assert not problems, "\n".join(problems) + "\n(refresh the values with: python tests/test_docs.py --write)"


def test_shared_config_blocks_agree():
    for first, second, prefixes in SHARED_BLOCKS:
        a = {k: v for k, v in _load_config(first).items() if k.startswith(prefixes)}
        b = {k: v for k, v in _load_config(second).items() if k.startswith(prefixes)}
        assert a == b, f"{first} and {second} differ in {prefixes}: docs/reference/config.md needs a table for each"


# ------------------------------------------------------------------------------- the checkers can fail


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n## 1. Start\n\n### 1.2 Details\n\n## Data formats: what's in `x.json`\n\n"
        "See [the start](#1-start), [details](#12-details) and [formats](#data-formats-whats-in-xjson).\n",
        encoding="utf-8")
    return tmp_path


def test_citation_checker_reports_missing_documents_and_sections(tree):
    src = tree / "mod.py"
    src.write_text('"""See docs/guide.md §1.2 and docs/guide.md section 1.\n'
                   "Also docs/guide.md §1, §7 and docs/absent.md.\n"
                   '(``docs/guide.md`` 3.1 and docs/guide.md §1-2)."""\n', encoding="utf-8")
    assert citation_problems([src], tree) == [
        "mod.py:2: docs/guide.md has no section 7",
        "mod.py:2: docs/absent.md does not exist",
        "mod.py:3: docs/guide.md has no section 3.1",
        "mod.py:3: docs/guide.md has no section 2",
    ]


def test_bare_section_checker(tree):
    bare, named = tree / "bare.py", tree / "named.py"
    bare.write_text("x = 1\n# the cache layout (docs §3.1)\n", encoding="utf-8")
    named.write_text("# docs/guide.md\n# as in §1.2\n", encoding="utf-8")
    assert bare_section_files([bare, named], tree) == {"bare.py": [2]}


def test_link_checker_reports_missing_files_and_anchors(tree):
    (tree / "README.md").write_text(
        "# Top\n\n[ok](docs/guide.md#12-details) [ok](#top) [web](https://example.com/x.md)\n"
        "[gone](docs/gone.md) [bad anchor](docs/guide.md#2-missing) [self](#nowhere)\n"
        "```\n[in code](not/checked.md)\n```\n", encoding="utf-8")
    problems = link_problems([tree / "README.md", tree / "docs" / "guide.md"], tree)
    assert problems == ["README.md:4: link target docs/gone.md does not exist",
                        "README.md:4: docs/guide.md has no heading with anchor #2-missing",
                        "README.md:4: README.md has no heading with anchor #nowhere"]


def test_github_slugs():
    assert github_slug("Data formats: what's in `x.json`") == "data-formats-whats-in-xjson"
    assert github_slug("2.4 Rotary embedding (partial, \"interleaved M-RoPE\")") == \
        "24-rotary-embedding-partial-interleaved-m-rope"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def test_mention_checker(tree):
    (tree / "jaxrl").mkdir()
    (tree / "jaxrl" / "real.py").write_text("", encoding="utf-8")
    md = tree / "docs" / "page.md"
    md.write_text("`jaxrl/real.py` and jaxrl/fake.py; `python -m jaxrl.real`, python -m jaxrl.fake, "
                  "python -m pip install x; jaxrl/fake_*.py, jaxrl/NAME.py, python -m jaxrl.NAME\n", encoding="utf-8")
    assert mention_problems([md], tree) == ["docs/page.md:1: jaxrl/fake.py does not exist",
                                            "docs/page.md:1: python -m jaxrl.fake: no such module"]


def test_dotted_name_checker(tree):
    md = tree / "docs" / "api.md"
    md.write_text("`jaxrl.models.adapters.load_adapter`, jaxrl.algorithms.run.run_training, format jaxrl.splits/1;\n"
                  "jaxrl.train.checkpoints.no_such_function and jaxrl.train.no_such_module.\n", encoding="utf-8")
    assert dotted_name_problems([md], tree) == [
        "docs/api.md:2: jaxrl.train.checkpoints.no_such_function: jaxrl.train.checkpoints has no no_such_function",
        "docs/api.md:2: jaxrl.train.no_such_module: jaxrl.train has no no_such_module",
    ]


def test_layout_checker(tree):
    for page in ("guides/how-to-x.md", "reference/keys-2.md", "design/Snake_Case.md", "design/camelCase.md",
                 "reference/notes.txt", "loose-page.md", "Guides_Old/page.md"):
        (tree / "docs" / page).parent.mkdir(parents=True, exist_ok=True)
        (tree / "docs" / page).write_text("# Page\n", encoding="utf-8")
    (tree / "docs" / "README.md").write_text("# Index\n", encoding="utf-8")
    assert layout_problems(tree) == [
        "docs/Guides_Old: not a kebab-case folder name (a-z, 0-9 and '-'; pages end in .md: my-page.md)",
        "docs/Guides_Old/page.md: a page belongs in docs/{guides,reference,design}/",
        "docs/design/Snake_Case.md: not a kebab-case page name (a-z, 0-9 and '-'; pages end in .md: my-page.md)",
        "docs/design/camelCase.md: not a kebab-case page name (a-z, 0-9 and '-'; pages end in .md: my-page.md)",
        "docs/guide.md: a page belongs in docs/{guides,reference,design}/",
        "docs/loose-page.md: a page belongs in docs/{guides,reference,design}/",
        "docs/reference/notes.txt: not a kebab-case page name (a-z, 0-9 and '-'; pages end in .md: my-page.md)",
    ]


def test_index_checker(tree):
    (tree / "docs" / "guides").mkdir()
    (tree / "docs" / "guides" / "listed.md").write_text("# Listed\n", encoding="utf-8")
    (tree / "docs" / "guides" / "forgotten.md").write_text("# Forgotten\n", encoding="utf-8")
    (tree / "docs" / "README.md").write_text(
        "# Index\n\n[listed](guides/listed.md#listed) [guide](guide.md)\n```\n[fenced](guides/forgotten.md)\n```\n",
        encoding="utf-8")
    assert index_problems(tree) == ["docs/guides/forgotten.md: not linked from docs/README.md"]


def test_config_table_checker_and_writer():
    text = ("# Keys\n\n<!-- config-table: t -->\n| key | value | meaning |\n|---|---|---|\n"
            "| `a` | `1` | the a |\n| `b.c` | `x` | the \\| c |\n| `gone` | `0` | old |\n\nAfter.\n")
    expected = {"t": {"a": "2", "b.c": "x", "new": '""'}}
    assert parse_tables(text) == {"t": [("a", "1", "the a"), ("b.c", "x", "the \\| c"), ("gone", "0", "old")]}
    assert table_problems(parse_tables(text), expected, "f.md") == [
        "f.md: table t: a is documented as 1, the config has 2",
        'f.md: table t: key new (value "") is missing',
        "f.md: table t: gone is not a key of the config",
    ]
    rewritten = write_tables(text, expected)
    assert rewritten.endswith("\n\nAfter.\n")
    assert table_problems(parse_tables(rewritten), expected, "f.md") == ["f.md: table t: new has no meaning"]
    assert table_problems(parse_tables(rewritten), {"u": {}}, "f.md") == ["f.md: no table <!-- config-table: u -->"]


def test_format_value():
    import ml_collections
    assert [format_value(v) for v in ("", "adamw", 1e-6, (1, -1, 1), True, None, ml_collections.ConfigDict())] == \
        ['""', "adamw", "1e-06", "(1, -1, 1)", "True", "None", "{}"]


def main(argv: Sequence[str]) -> int:
    if list(argv) != ["--write"]:
        print(__doc__)
        return 2
    sys.path.insert(0, str(ROOT))
    CONFIG_DOC.write_text(write_tables(CONFIG_DOC.read_text(encoding="utf-8"), expected_tables()), encoding="utf-8")
    print(f"wrote {CONFIG_DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
