import pytest

from hetpipe_tf.planning.devices import DeviceSpec, DeviceSpecError, parse_devices
from hetpipe_tf.runtime.logical_devices import configure_tensorflow_devices


def test_parse_forms():
    assert parse_devices("1@512M, emu:0.5@1G,cpu,gpu:1@2G,gpu") == (
        DeviceSpec("emulated", speed=1.0, memory=512 * 2 ** 20),
        DeviceSpec("emulated", speed=0.5, memory=2 ** 30),
        DeviceSpec("cpu"), DeviceSpec("gpu", index=1, memory=2 * 2 ** 30), DeviceSpec("gpu", index=0))
    assert str(parse_devices("0.25@1.5G")[0]) == "emulated device (speed 0.25, memory 1.5 GiB)"


@pytest.mark.parametrize("text,match", [
    ("", "no devices"), ("fast", "cannot read device 'fast'"), ("0@1G", "speed must be > 0"),
    ("1@lots", "cannot read memory size 'lots'"), ("cpu@1G", "takes no memory limit"),
    ("gpu:x", "cannot read device"), ("1@0M", "must be > 0")])
def test_parse_errors_say_what_is_allowed(text, match):
    with pytest.raises(DeviceSpecError, match=match):
        parse_devices(text)


def test_emulated_devices_get_logical_cpus():
    names = configure_tensorflow_devices(parse_devices("1,1,1"))
    assert names == ("/device:CPU:0", "/device:CPU:1", "/device:CPU:2")


def test_gpu_devices_resolve_or_fail_clearly():
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    with pytest.raises(DeviceSpecError, match=f"TensorFlow sees {len(gpus)} GPU"):
        configure_tensorflow_devices(parse_devices(f"gpu:{len(gpus)}"))
    if gpus:
        assert "GPU" in configure_tensorflow_devices(parse_devices("gpu:0"))[0]
