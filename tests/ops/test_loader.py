"""The op library's loader: it finds this checkout's library built for the running TensorFlow, and
refuses a missing library or one built for another TensorFlow with the command that rebuilds it
where the package is (a checkout's editable install, or an installed package's reinstall from
source against the TensorFlow installed now). The reinstall itself runs in the wheel check
(tests/wheel_check.py --remedy)."""
import os

import pytest
import tensorflow as tf

from hetpipe_tf.ops import loader


def _package(root, with_setup):
    """A package's ops directory under `root`, with setup.py beside the package (a checkout) or not."""
    ops = root / "hetpipe_tf" / "ops"
    ops.mkdir(parents=True)
    if with_setup:
        (root / "setup.py").write_text("")
    return ops


def test_this_checkout_loads_its_library_built_for_the_running_tensorflow():
    path = loader.library_path()
    loader.check_build(os.path.dirname(path), tf.__version__)
    assert callable(loader.load_ops().hetpipe_weight_stash_put)


def test_a_missing_library_in_a_checkout_names_its_editable_rebuild(tmp_path):
    ops = _package(tmp_path / "src", with_setup=True)
    with pytest.raises(loader.OpsLibraryError,
                       match=f"not built.*pip install --no-build-isolation -e .*in {tmp_path / 'src'}"):
        loader.library_path(str(ops))


def test_a_missing_library_installed_names_a_reinstall_from_source(tmp_path):
    ops = _package(tmp_path / "site-packages", with_setup=False)
    with pytest.raises(loader.OpsLibraryError) as raised:
        loader.library_path(str(ops))
    assert "not built" in str(raised.value)
    assert ("pip install --force-reinstall --no-deps --no-build-isolation --no-binary hetpipe_tf SOURCE"
            in str(raised.value))
    assert "-e ." not in str(raised.value)


def test_a_library_built_for_another_tensorflow_names_both_versions_and_the_reinstall(tmp_path):
    ops = _package(tmp_path / "site-packages", with_setup=False)
    (ops / "_hetpipe_ops_build.json").write_text('{"tensorflow_version": "2.15.1"}')
    with pytest.raises(loader.OpsLibraryError, match=r"built against TensorFlow 2\.15\.1, but TensorFlow 2\.21\.0 "
                                                     r"is installed; rebuild them with: pip install --force-reinstall"):
        loader.check_build(str(ops), "2.21.0")


def test_an_unreadable_build_record_names_the_rebuild(tmp_path):
    ops = _package(tmp_path / "src", with_setup=True)
    (ops / "_hetpipe_ops_build.json").write_text("{not json")
    with pytest.raises(loader.OpsLibraryError, match="no readable build record.*pip install --no-build-isolation -e"):
        loader.check_build(str(ops), "2.21.0")
