"""What README.md and the pages under docs/ name in their prose exists in the code: the flags, the
dotted names under hetpipe_tf, the keyword arguments, and the tests they cite. (Their code blocks
run in tests/docs/test_docs_code.py; the API reference is checked in test_api_reference.py.)"""
import ast
import importlib
import importlib.util
import inspect
import pathlib
import re

import keras
import pytest

import hetpipe_tf
from tests.docs.blocks import ROOT

#: The pages, but the generated command line reference and the benchmarks' log.
PAGES = [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").rglob("*.md"))
                                if "benchmarks" not in p.relative_to(ROOT).parts and p.name != "cli.md"]
#: Flags of other programs that the pages name, and whose they are.
OTHER_PROGRAMS_FLAGS = {
    "helpfull": "absl (every binary)", "verbosity": "absl (every binary)", "force": "pip (--force-reinstall)",
    "no": "pip (--no-deps, --no-build-isolation, --no-binary) and lint-imports (--no-cache)",
    "strict": "mkdocs build", "dport": "iptables", "distribution": "srun",
}


def _mentions(pattern: str) -> dict[str, list[str]]:
    """{match: [page:line, ...]} of a regex's first group in the pages' text."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for match in re.finditer(pattern, line):
                found.setdefault(match.group(1), []).append(f"{page.relative_to(ROOT)}:{number}")
    return found


def _defined_flags() -> set[str]:
    """Every absl flag and argparse option defined in the package, and those of tests/wheel_check.py
    and of the benchmark scripts the pages tell users to run."""
    sources = [*sorted((ROOT / "hetpipe_tf").rglob("*.py")), ROOT / "tests" / "wheel_check.py",
               *sorted((ROOT / "benchmarks").glob("*.py"))]
    text = "\n".join(p.read_text() for p in sources)
    return set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", text)) | set(re.findall(r"add_argument\(\s*\"--(\w+)\"", text))


def test_every_flag_the_pages_name_is_defined():
    defined = _defined_flags()
    assert {"num_in_flight", "staleness_bound", "cluster", "vw_size", "task_log_dir"} <= defined
    unknown = {flag: where for flag, where in _mentions(r"(?<![\w-])--([a-z][a-z0-9_]*)\b(?!\()").items()
               if flag not in defined and flag not in OTHER_PROGRAMS_FLAGS}
    assert unknown == {}, f"flags the pages name that nothing defines: {unknown}"


def _resolves(dotted: str) -> bool:
    """Whether `dotted` is a module or an attribute of one. A module is found, not imported: the
    entry-point modules define their absl flags on import, and two of them (a task's server and a
    virtual worker's process) define the same names, so they cannot both be imported in one process."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        try:
            if importlib.util.find_spec(".".join(parts[:end])) is None:
                continue
        except ImportError:
            continue
        if end == len(parts):
            return True
        value = importlib.import_module(".".join(parts[:end]))
        for attribute in parts[end:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


def test_every_name_under_hetpipe_tf_the_pages_give_exists():
    names = {name: where for name, where in _mentions(r"(hetpipe_tf(?:\.[A-Za-z_]\w*)+)").items()
             if not name.endswith((".py", ".md", ".so"))}
    assert len(names) >= 40
    missing = {name: where for name, where in names.items() if not _resolves(name)}
    assert missing == {}, f"names the pages give that do not exist: {missing}"


def test_every_method_of_an_exported_class_the_pages_name_exists():
    mentioned = _mentions(r"`([A-Z][A-Za-z]+\.[a-z_]\w*)")
    checked = {name: where for name, where in mentioned.items() if name.split(".")[0] in hetpipe_tf._EXPORTS}
    assert len(checked) >= 5
    missing = {}
    for name, where in checked.items():
        cls, attribute = name.split(".")
        value = getattr(hetpipe_tf, cls)
        fields = getattr(value, "__dataclass_fields__", {})
        if not hasattr(value, attribute) and attribute not in fields:
            missing[name] = where
    assert missing == {}, f"attributes the pages name that their class does not have: {missing}"


def _parameter_names() -> set[str]:
    """The parameters of every exported callable and its methods, of the planner's entry points,
    and of the Keras calls the pages show them with."""
    from hetpipe_tf.planning.cluster import load_cluster
    from hetpipe_tf.planning.planner import plan
    from hetpipe_tf.planning.request import PlanRequest
    values = [getattr(hetpipe_tf, name) for name in hetpipe_tf.__all__]
    values += [PlanRequest, plan, load_cluster, keras.Model.fit, keras.Model.compile, keras.optimizers.SGD,
               keras.optimizers.AdamW]
    names: set[str] = set()
    for value in values:
        functions = [value] + ([v for v in vars(value).values() if callable(v)] if inspect.isclass(value) else [])
        for function in functions:
            try:
                names |= set(inspect.signature(function).parameters)
            except (TypeError, ValueError):
                pass
    return names


#: Keyword arguments the pages name of calls outside hetpipe_tf and Keras's fit and compile.
OTHER_KEYWORDS = {"drop_remainder": "tf.data.Dataset.batch"}
#: Keyword arguments of the schedules' instructions (hetpipe_tf.pipeline.instructions), in
#: architecture.md's description of them.
INSTRUCTION_KEYWORDS = {"recompute", "live", "window", "waits"}


def test_every_keyword_argument_the_pages_name_is_a_parameter():
    known = _parameter_names() | set(OTHER_KEYWORDS) | INSTRUCTION_KEYWORDS
    assert {"staleness_bound", "checkpoint_dir", "num_in_flight", "launch"} <= known
    keywords: dict[str, list[str]] = {}
    for page in PAGES:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for code in re.findall(r"`([^`]+)`", line):
                for match in re.finditer(r"(?<![\w.-])([a-z_][a-z0-9_]*)=", code):
                    keywords.setdefault(match.group(1), []).append(f"{page.relative_to(ROOT)}:{number}")
    unknown = {keyword: where for keyword, where in keywords.items() if keyword not in known}
    assert unknown == {}, f"keyword arguments the pages name that no public callable has: {unknown}"


def _test_names() -> dict[pathlib.Path, set[str]]:
    return {path: {node.name for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
            for path in (ROOT / "tests").rglob("test_*.py")}


def test_every_test_the_pages_cite_exists():
    """`dir/test_file.py`, `dir/test_file.py::test_name` (that test in that file) and a bare
    `::test_name` or `test_name[params]` (a test in some file: the page's table says which)."""
    tests = _test_names()
    everywhere = set().union(*tests.values())
    cited = _mentions(r"`((?:tests/)?[\w/]*test_\w+\.py(?:::test_\w+)?|(?:::)?test_\w+(?=[\[`]))")
    assert len(cited) >= 40
    missing = {}
    for citation, where in cited.items():
        file, _, name = citation.rpartition("::") if "::" in citation else (
            (citation, "", "") if citation.endswith(".py") else ("", "", citation))
        if file:
            path = ROOT / (file if file.startswith("tests/") else f"tests/{file}")
            if path not in tests or (name and name not in tests[path]):
                missing[citation] = where
        elif name not in everywhere:
            missing[citation] = where
    assert missing == {}, f"tests the pages cite that do not exist: {missing}"


@pytest.mark.parametrize("page", ["architecture.md", "failures-and-checkpoints.md"])
def test_a_shared_layer_is_said_to_be_replicated_not_refused(page):
    """A layer called in two stages has a replica in each (runtime/update_terms.py); only one with
    state of its own is refused."""
    text = " ".join((ROOT / "docs" / page).read_text().split())
    assert "shared weights) is refused" not in text and "a layer shared by two stages;" not in text
    assert "state of its own" in text


#: Words no user can decode: the project's source documents called seeds, and issue numbers.
_JARGON = re.compile(r"\bseeds? ?0\d\d\b|\bseed's\b|\bno seed\b|\bthe seeds?\b(?! of| for| \d| [a-z]+=)|"
                     r"\bissue ?#?\d+|\bthe issue's\b", re.IGNORECASE)


def test_no_page_or_source_speaks_of_seeds_or_issue_numbers():
    files = [*PAGES, *sorted((ROOT / "hetpipe_tf").rglob("*.py")), *sorted((ROOT / "examples").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*.md"))]
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for path in files
             for number, line in enumerate(path.read_text().splitlines(), 1) if _JARGON.search(line)]
    assert found == []


def test_every_error_the_pages_name_is_exported_or_a_builtin():
    import builtins

    named = _mentions(r"`([A-Z][A-Za-z]+(?:Error|Aborted|Deadlock|Violation))`")
    assert {"TaskLostError", "PlanError"} <= set(named)
    unknown = {name: where for name, where in named.items()
               if name not in hetpipe_tf._EXPORTS and not hasattr(builtins, name)}
    assert unknown == {}, f"errors the pages name that hetpipe_tf does not export: {unknown}"
