"""hetpipe_tf.compat holds every reach into Keras's and TensorFlow's private parts: the installed
versions still have each one, a missing one is named, and no other module reaches them."""
import ast
import pathlib

import pytest

from hetpipe_tf import compat

PACKAGE = pathlib.Path(compat.__file__).parent
PRIVATE_MODULES = ("keras.src", "tensorflow.python")
# Private attributes still reached at their own site (named in compat, so missing() tries them).
REACHED_AT_SITE = {("runtime/compiled.py", "_inference_function"), ("runtime/compiled.py", "_garbage_collector"),
                   ("runtime/compiled.py", "_func_graph"), ("runtime/compiled.py", "_delayed_rewrite_functions"),
                   ("runtime/compiled.py", "_attrs"), ("runtime/compiled.py", "_FirstOrderTapeGradientFunctions"),
                   ("runtime/fit_loop.py", "_learning_rate"), ("runtime/checkpoint.py", "_trainable_variables"),
                   ("runtime/checkpoint.py", "_variables"), ("runtime/profiler.py", "_self_attention_layer")}


def test_the_installed_versions_have_every_private_part_reached():
    assert compat.missing() == []


def test_a_private_attribute_that_is_gone_is_named_with_why():
    compat._attribute("Layer", "_no_such_attribute", "to show that a missing one is named")
    try:
        gone = compat.missing()
    finally:
        compat.REACHES.pop()
    assert len(gone) == 1 and gone[0].startswith("Layer._no_such_attribute (to show that a missing one is named)")
    assert compat.CHECKED_ON in gone[0]


def test_a_private_import_that_is_gone_fails_naming_it():
    try:
        with pytest.raises(ImportError, match=r"keras\.src\.no_such_module\.Thing \(to show it\).*checked on"):
            compat._imported("keras.src.no_such_module", "Thing", "to show it")
        with pytest.raises(ImportError, match=r"keras\.src\.models\.functional\.NoSuchName"):
            compat._imported("keras.src.models.functional", "NoSuchName", "to show it")
    finally:
        del compat.REACHES[-2:]


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "compat.py" or path.parent != PACKAGE:
            yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def test_no_other_module_imports_keras_src_or_tensorflow_python():
    found = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{name}:{node.lineno} {m}" for m in modules
                      if any(m == p or m.startswith(p + ".") for p in PRIVATE_MODULES)]
    assert found == [], "import these through hetpipe_tf/compat.py: " + ", ".join(found)


def test_no_other_module_reaches_the_private_attributes_compat_names():
    names = {r.what.partition(".")[2] for r in compat.REACHES if r.what.split(".")[0][:1].isupper()}
    assert "_keras_history" in names and "_var_key" in names
    found = []
    for module, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue  # an attribute of one's own
                attribute = node.attr
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                attribute = node.value  # getattr(x, "_name")
            else:
                continue
            if attribute in names and (module, attribute) not in REACHED_AT_SITE:
                found.append(f"{module}:{node.lineno} {attribute}")
    assert found == [], "reach these through hetpipe_tf/compat.py: " + ", ".join(found)
