import pytest

import modelpatch
from modelpatch import clear_patch_mapping, set_strict_patching


@pytest.fixture(autouse=True)
def _clean_registry():
    """Every test starts and ends with an empty registry and strict mode off."""
    clear_patch_mapping()
    set_strict_patching(False)
    yield
    clear_patch_mapping()
    set_strict_patching(False)
    assert modelpatch.patching.scopes.active_scopes() == ()
