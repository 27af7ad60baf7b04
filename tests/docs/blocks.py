"""The code blocks of README.md and the pages under docs/, as the docs' tests run them.

A fenced block whose language is ``python``, ``sh``, ``bash`` or ``shell`` is run as it stands,
unless an HTML comment on the line right above its fence (invisible on the rendered page) says
otherwise:

* ``<!-- docs-test: not run: REASON -->``: the block is not run, for REASON (a GPU, other hosts,
  the test suite itself); the reason is required.
* ``<!-- docs-test: replace "OLD" "NEW"; replace "OLD2" "NEW2"; timeout 300 -->``: the block runs
  with each OLD replaced by NEW (each must occur in the block), where the page's figure would take
  minutes (``epochs=12`` made ``epochs=1``), and with the timeout given in seconds (default 240).
* ``<!-- docs-test: slow: REASON; ... -->``: the block runs among the tests marked slow (``make
  test-all``), for REASON: the test of CI's subset that goes through the same path.

Python blocks run with the interpreter of the tests, shell blocks with ``bash -e`` and that
interpreter's scripts first on PATH; both in an empty directory of their own, with the checkout on
PYTHONPATH and ``HETPIPE_DOCS_TEST=1`` set.
"""
import dataclasses
import pathlib
import re
import shlex

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: The languages that run; any other fence (text, json, a diagram) is not code to run.
LANGUAGES = {"python": "python", "sh": "shell", "bash": "shell", "shell": "shell"}
DEFAULT_TIMEOUT_S = 240.0
_FENCE = re.compile(r"^(```+)\s*([\w+-]*)")
_DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One code block: where it is, its language ("python" or "shell") and the code as run."""
    path: pathlib.Path
    line: int
    language: str
    code: str
    not_run: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    slow: str | None = None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """README.md and every page under docs/ but the benchmarks' log (docs/benchmarks links to it)."""
    docs = [p for p in sorted((root / "docs").rglob("*.md")) if "benchmarks" not in p.relative_to(root).parts]
    return [root / "README.md", *docs]


def _directive(text: str, block_code: str, where: str) -> tuple[str, str | None, float, str | None]:
    """The code as run, the reason it is not run (or None), its timeout and the reason it is slow
    (or None), from a directive."""
    if text.startswith("not run:"):
        reason = text[len("not run:"):].strip()
        if not reason:
            raise ValueError(f"{where}: 'docs-test: not run:' needs the reason the block is not run")
        return block_code, reason, DEFAULT_TIMEOUT_S, None
    code, timeout, slow = block_code, DEFAULT_TIMEOUT_S, None
    for part in filter(None, (p.strip() for p in text.split(";"))):
        if part.startswith("slow:"):
            slow = part[len("slow:"):].strip()
            continue
        words = shlex.split(part)
        if words[0] == "replace" and len(words) == 3:
            if words[1] not in code:
                raise ValueError(f"{where}: replace {words[1]!r}: not in the block")
            code = code.replace(words[1], words[2])
        elif words[0] == "timeout" and len(words) == 2:
            timeout = float(words[1])
        else:
            raise ValueError(f"{where}: unknown docs-test directive {part!r}; allowed: 'not run: REASON', "
                             f"'slow: REASON', 'replace \"OLD\" \"NEW\"', 'timeout SECONDS'")
    return code, None, timeout, slow


def blocks(path: pathlib.Path) -> list[Block]:
    """The blocks of one page that are code to run (see the module docstring)."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), len(lines))
        language = LANGUAGES.get(fence.group(2).lower())
        if language:
            where = f"{path.relative_to(ROOT)}:{i + 1}"
            code = "\n".join(lines[i + 1:end]) + "\n"
            directive = _DIRECTIVE.match(lines[i - 1]) if i else None
            code, not_run, timeout, slow = _directive(directive.group(1), code, where) if directive else (
                code, None, DEFAULT_TIMEOUT_S, None)
            found.append(Block(path, i + 1, language, code, not_run, timeout, slow))
        i = end + 1
    return found


def all_blocks(root: pathlib.Path = ROOT) -> list[Block]:
    return [b for page in pages(root) for b in blocks(page)]
