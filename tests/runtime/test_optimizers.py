import keras
import pytest

from hetpipe_tf.runtime.optimizers import UnsupportedOptimizerError, check_optimizer, stage_optimizer


def test_supported_optimizers_are_copied_with_their_config():
    opt = keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True)
    copy = stage_optimizer(opt)
    assert copy is not opt and copy.get_config() == opt.get_config()
    assert isinstance(check_optimizer("adam"), keras.optimizers.Adam)


def test_unsupported_optimizer_names_the_supported_ones():
    with pytest.raises(UnsupportedOptimizerError,
                       match=r"optimizer Adagrad is not supported; supported: keras.optimizers.SGD, "
                             r"keras.optimizers.Adam, keras.optimizers.RMSprop"):
        check_optimizer(keras.optimizers.Adagrad())
    with pytest.raises(UnsupportedOptimizerError, match="global_clipnorm"):
        check_optimizer(keras.optimizers.SGD(global_clipnorm=1.0))
