"""What the model tests share: running the emflow binary that ctest names (EMFLOW_CLI) and the
error measure of the parity tests."""
import os
import subprocess

import numpy as np
import pytest

CLI = os.environ.get("EMFLOW_CLI")


def run(*args, ok=True):
    """Runs `emflow ARGS`; with ok, asserts it succeeded (its stderr is the message)."""
    if not CLI:
        pytest.skip("EMFLOW_CLI is not set (run through ctest)")
    result = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True)
    if ok:
        assert result.returncode == 0, result.stderr
    return result


def relative_error(ours, theirs, lengths):
    """max |ours - theirs| / max |theirs| over the real (non-padding) rows of every cloud."""
    worst, scale = 0.0, 0.0
    for b, n in enumerate(lengths):
        worst = max(worst, float(np.max(np.abs(ours[b, :n] - theirs[b, :n]))))
        scale = max(scale, float(np.max(np.abs(theirs[b, :n]))))
    return worst / scale
