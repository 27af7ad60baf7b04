"""One error tree: every exception class of hetpipe_tf derives from HetPipeError through one of its
two branches, keeps its builtin base, and is importable from hetpipe_tf."""
import ast
import builtins
import pathlib

import pytest

import hetpipe_tf
from hetpipe_tf import errors

PACKAGE = pathlib.Path(hetpipe_tf.__file__).parent


def _classes():
    """{name: (module, base names)} of every class defined at any depth in the package's sources."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found[node.name] = (module, [ast.unparse(base).split(".")[-1] for base in node.bases])
    return found


def _exception_classes():
    """{name: module} of the classes whose bases lead to a builtin exception, found from the source."""
    classes = _classes()

    def is_exception(name):
        builtin = getattr(builtins, name, None)
        if isinstance(builtin, type) and issubclass(builtin, BaseException):
            return True
        return name in classes and any(is_exception(base) for base in classes[name][1])

    return {name: module for name, (module, _) in classes.items() if is_exception(name)}


EXCEPTIONS = _exception_classes()
# Private classes never leave their module (allocation's signal that a search ran out of states).
PUBLIC = sorted(name for name in EXCEPTIONS if not name.startswith("_"))


def test_the_scan_finds_the_package_s_errors():
    assert {"PlanError", "PipelineError", "TaskLostError", "WorkerProcessError", "HetPipeError"} <= set(PUBLIC)
    assert len(PUBLIC) >= 34  # 31 when the tree was made, and its root and two branches


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_exception_is_exported_and_in_the_tree(name):
    cls = getattr(hetpipe_tf, name)
    assert name in hetpipe_tf.__all__
    assert cls.__module__ == EXCEPTIONS[name], f"hetpipe_tf.{name} is not the class defined in {EXCEPTIONS[name]}"
    assert issubclass(cls, errors.HetPipeError)
    if cls is not errors.HetPipeError:
        assert issubclass(cls, errors.HetPipeUsageError) != issubclass(cls, errors.HetPipeRunError), \
            f"{name} must be in exactly one branch"


@pytest.mark.parametrize("name,builtin", [
    ("PlanError", ValueError), ("DeviceSpecError", ValueError), ("DatasetNotFoundError", FileNotFoundError),
    ("UnsupportedModelError", TypeError), ("DeviceOutOfMemoryError", MemoryError),
    ("NonFiniteError", FloatingPointError), ("OpsLibraryError", ImportError), ("TaskLostError", RuntimeError),
    ("StalenessViolation", AssertionError)])
def test_the_builtin_bases_stay_so_existing_handlers_still_catch(name, builtin):
    assert issubclass(getattr(hetpipe_tf, name), builtin)


def test_the_errors_module_imports_nothing_of_the_package():
    tree = ast.parse((PACKAGE / "errors.py").read_text())
    imported = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imported == []


def test_the_errors_page_names_every_public_exception():
    page = (PACKAGE.parent / "docs" / "api" / "errors.md").read_text()
    assert [name for name in PUBLIC if f"`{name}`" not in page and f".{name}" not in page] == []
