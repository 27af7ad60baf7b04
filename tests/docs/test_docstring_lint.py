"""The docstring linter (ruff.toml, run by `make test`) lints the public modules, those the API
reference documents, and they pass it; the modules that do not meet a rule yet are listed in
ruff.toml, and that list only shrinks."""
import pathlib
import re
import subprocess
import sys
import tomllib

from tests.docs.blocks import ROOT

CONFIG = tomllib.loads((ROOT / "ruff.toml").read_text())
#: How many (module, rule) pairs ruff.toml's per-file-ignores may hold at most: lower it as
#: docstrings are completed, never raise it.
MOST_EXEMPTIONS = 16


def _api_modules() -> set[str]:
    """The source file of every module the API pages (docs/api/*.md) have an entry from."""
    files = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        for dotted in re.findall(r"^::: ([\w.]+)\s*$", page.read_text(), re.M):
            parts = dotted.split(".")
            for end in range(len(parts), 1, -1):
                base = ROOT.joinpath(*parts[:end])
                found = [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()]
                if found:
                    files.add(str(found[0].relative_to(ROOT)))
                    break
    return files


def test_the_linter_lints_the_modules_of_the_api_reference():
    assert set(CONFIG["include"]) == _api_modules()
    assert {"DOC201", "DOC501", "D417", "D102"} <= set(CONFIG["lint"]["select"])


def test_the_exemptions_name_linted_modules_and_selected_rules_and_only_shrink():
    exemptions = CONFIG["lint"].get("per-file-ignores", {})
    assert set(exemptions) <= set(CONFIG["include"])
    assert all(set(rules) <= set(CONFIG["lint"]["select"]) for rules in exemptions.values())
    assert sum(len(rules) for rules in exemptions.values()) <= MOST_EXEMPTIONS


def test_the_public_modules_pass_the_docstring_linter():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
