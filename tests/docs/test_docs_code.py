"""Every Python and shell block of README.md and docs/ runs (tests/docs/blocks.py says how a
block is shrunk to a small size or marked not run, with its reason)."""
import os
import subprocess
import sys

import pytest

from tests.docs.blocks import ROOT, all_blocks

BLOCKS = all_blocks()
RUN = [pytest.param(b, id=b.name, marks=[pytest.mark.slow] if b.slow else []) for b in BLOCKS if b.not_run is None]


def _environment(tmp_path) -> dict:
    env = dict(os.environ, HETPIPE_DOCS_TEST="1", TF_CPP_MIN_LOG_LEVEL="2", TFDS_DATA_DIR=str(tmp_path / "tfds"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


@pytest.mark.parametrize("block", RUN)
def test_the_block_runs(block, tmp_path):
    command = [sys.executable, "-c", block.code] if block.language == "python" else ["bash", "-e", "-c", block.code]
    done = subprocess.run(command, cwd=tmp_path, env=_environment(tmp_path), capture_output=True, text=True,
                          timeout=block.timeout_s)
    assert done.returncode == 0, (f"{block.name} ({block.language}) exited {done.returncode}:\n{block.code}\n"
                                  f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-6000:]}")


def test_the_pages_have_code_and_every_block_not_run_or_slow_says_why():
    assert len(RUN) >= 5, [b.name for b in BLOCKS]
    for block in BLOCKS:
        assert block.not_run is None or len(block.not_run) > 10, block.name
        assert block.slow is None or len(block.slow) > 10, block.name


def test_the_concepts_picture_is_drawn_by_its_script(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "concepts.py"), str(tmp_path / "concepts.png")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "concepts.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
