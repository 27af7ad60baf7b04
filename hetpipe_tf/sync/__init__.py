"""Synchronisation between virtual workers (HetPipe §5): the schemes behind the
synchronisation seam (WSP), the staleness rules and the parameter servers that hold the
global weights."""

from hetpipe_tf.sync import wsp  # noqa: E402,F401 - registers the "wsp" scheme
from hetpipe_tf.sync import ssp  # noqa: E402,F401 - registers "bsp", "ssp" and "asp"
from hetpipe_tf.sync import pipe_sgd  # noqa: E402,F401 - registers "pipe-sgd"
