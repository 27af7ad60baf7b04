"""Marks of the tests that need what not every machine has."""
import os
import shutil

import pytest

#: Emulated links (hetpipe_tf.distributed.netlinks) make network namespaces and shape traffic.
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
                                reason="emulated links need root and iproute2 (ip, tc)")
