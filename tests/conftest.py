import os

import pytest
import torch

import modelpatch
from modelpatch import clear_patch_mapping, set_strict_patching

# Every model here is tiny (hidden size 64): intra-op threads only add overhead, and on a busy 2-core machine their
# spin-waits made tests several times slower (routing tests: 18 s with one thread, 51-190 s with two). Subprocesses
# started by tests inherit the setting; set OMP_NUM_THREADS to choose another count.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _clean_registry():
    """Every test starts and ends with an empty registry and strict mode off."""
    clear_patch_mapping()
    set_strict_patching(False)
    yield
    clear_patch_mapping()
    set_strict_patching(False)
    assert modelpatch.patching.scopes.active_scopes() == ()


def pytest_configure(config):
    """``MODELPATCH_EXPECT_TRANSFORMERS=X`` (set by .ci/run for each release's venv): refuse to run the suite when
    another Transformers release is imported, before a single test runs."""
    import transformers

    expected = os.environ.get("MODELPATCH_EXPECT_TRANSFORMERS")
    if expected and transformers.__version__ != expected:
        raise pytest.UsageError(
            f"MODELPATCH_EXPECT_TRANSFORMERS={expected} but transformers {transformers.__version__} is imported "
            f"(from {transformers.__file__}): install constraints/transformers-{expected.rsplit('.', 1)[0]}.txt"
        )
