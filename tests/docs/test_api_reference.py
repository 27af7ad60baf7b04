"""The API reference (docs/api/*.md) covers the API: every name ``hetpipe_tf`` exports and every name
the pages and examples import has an entry (``::: module.name``, which mkdocstrings renders from the
docstring), each entry names something that exists, the overview says truly which names ``import
hetpipe_tf`` gives, every parameter of an exported callable is named by its docstring, and the
runners' fit-loop methods (internal) are left out of the reference."""
import ast
import importlib
import inspect
import pathlib
import re

import pytest
import yaml

import hetpipe_tf
from tests.docs.blocks import ROOT, all_blocks

API = ROOT / "docs" / "api"
ENTRY = re.compile(r"^::: ([\w.]+)\s*$", re.M)


def _entries() -> dict[str, str]:
    """{dotted name: page} of every `::: NAME` entry of the API pages."""
    return {name: page.name for page in sorted(API.glob("*.md")) for name in ENTRY.findall(page.read_text())}


ENTRIES = _entries()
EXPORTS = {name: f"{module}.{name}" for name, module in hetpipe_tf._EXPORTS.items()}


def _imported_names() -> dict[str, str]:
    """{dotted name: where} of every name that a Python block of README.md or docs/, or a script of
    examples/, imports from hetpipe_tf (`from hetpipe_tf.MODULE import NAME`, or `hetpipe_tf.NAME`)."""
    sources = [(b.name, b.code) for b in all_blocks() if b.language == "python"]
    sources += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "examples").rglob("*.py"))]
    found = {}
    for where, code in sources:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hetpipe_tf"):
                for alias in node.names:
                    dotted = EXPORTS.get(alias.name, "") if node.module == "hetpipe_tf" else \
                        f"{node.module}.{alias.name}"
                    found[dotted or f"hetpipe_tf.{alias.name}"] = where
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "hetpipe_tf" and node.attr[:1].isupper() or
                  isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "hetpipe_tf" and node.attr in EXPORTS):
                found[EXPORTS.get(node.attr, f"hetpipe_tf.{node.attr}")] = where
    return found


def test_the_pages_have_entries_and_the_scan_finds_the_imports():
    assert len(ENTRIES) >= len(EXPORTS)
    imported = _imported_names()
    assert "hetpipe_tf.planning.planner.plan" in imported and "hetpipe_tf.api.strategy.HetPipeStrategy" in imported


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_every_exported_name_has_an_entry_in_the_reference(name):
    assert EXPORTS[name] in ENTRIES, (f"hetpipe_tf.{name} is exported but no page of docs/api has "
                                      f"'::: {EXPORTS[name]}'")


def test_every_name_the_pages_and_examples_import_has_an_entry():
    missing = {name: where for name, where in _imported_names().items() if name not in ENTRIES}
    assert missing == {}, "imported by the docs or examples, but not in docs/api: " + repr(missing)


@pytest.mark.parametrize("dotted", sorted(ENTRIES))
def test_every_entry_names_what_exists(dotted):
    module_name, _, attribute = dotted.rpartition(".")
    try:
        importlib.import_module(dotted)
        return  # a module's page
    except ModuleNotFoundError:
        pass
    assert hasattr(importlib.import_module(module_name), attribute), f"{ENTRIES[dotted]}: {dotted} does not exist"


def test_the_overview_says_which_names_import_hetpipe_tf_gives():
    """docs/api/index.md: a table row per area, the exported names in one column (each must be
    exported) and the others, with the module they are imported from, in the next."""
    page = (API / "index.md").read_text()
    rows = [line.split("|")[1:-1] for line in page.splitlines() if line.startswith("| [")]
    assert len(rows) >= 7
    said_exported = {ref for row in rows for ref in re.findall(r"\]\[([\w.]+)\]", row[1])}
    others = {ref for row in rows for ref in re.findall(r"\]\[([\w.]+)\]", row[2])}
    assert said_exported == set(EXPORTS.values()), sorted(said_exported ^ set(EXPORTS.values()))
    assert others.isdisjoint(EXPORTS.values())
    assert others <= set(ENTRIES)


def _parameters(value) -> list[str]:
    function = value.__init__ if inspect.isclass(value) else value
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.name not in ("self", "cls", "args", "kwargs")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _documented_callables() -> list[str]:
    return sorted(name for name in hetpipe_tf.__all__
                  if not (inspect.isclass(getattr(hetpipe_tf, name))
                          and issubclass(getattr(hetpipe_tf, name), BaseException)))


@pytest.mark.parametrize("name", _documented_callables())
def test_every_parameter_of_an_exported_callable_is_named_in_its_docstring(name):
    value = getattr(hetpipe_tf, name)
    text = " ".join(filter(None, [inspect.getdoc(value), inspect.isclass(value) and value.__init__.__doc__ or ""]))
    assert text, f"hetpipe_tf.{name} has no docstring"
    unnamed = [p for p in _parameters(value) if not re.search(rf"(?<![\w.]){re.escape(p)}(?!\w)", text)]
    assert unnamed == [], f"hetpipe_tf.{name}: its docstring never names {unnamed}"


#: The methods of the runners' protocol (hetpipe_tf.runtime.fit_loop) that users also call; the
#: others are the fit loop's alone, and the reference leaves them out (mkdocs.yml's filters).
USER_FACING = {"evaluate", "abort", "emulation_report", "run_state"}


def test_the_fit_loop_s_methods_are_left_out_of_the_reference():
    source = ast.parse((ROOT / "hetpipe_tf" / "runtime" / "fit_loop.py").read_text())
    protocol = {node.name for cls in ast.walk(source) if isinstance(cls, ast.ClassDef)
                and cls.name in ("Runner", "GlobalWeightsRunner") for node in cls.body
                if isinstance(node, ast.FunctionDef)}
    assert {"begin_fit", "train_segment", "evaluate"} <= protocol

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
    handler = next(p["mkdocstrings"] for p in config["plugins"] if isinstance(p, dict) and "mkdocstrings" in p)
    filters = handler["handlers"]["python"]["options"]["filters"]
    hidden = {m for m in protocol if any(f.startswith("!") and re.search(f[1:], m) for f in filters)}
    assert hidden == protocol - USER_FACING, "filter the fit loop's methods, and only them: " + repr(
        sorted(hidden ^ (protocol - USER_FACING)))
