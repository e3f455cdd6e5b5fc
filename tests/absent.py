"""Test modules whose trainer is not installed: each is one skip with the reason, never imported (its imports
would fail collection). A folder's conftest.py sets `pytest_pycollect_makemodule = skipped_modules(reason)`."""

import pytest


def skipped_modules(reason: str):
    class Absent(pytest.Module):
        def collect(self):
            pytest.skip(f"{self.path.name}: {reason}", allow_module_level=True)

    def make(module_path, parent):
        return Absent.from_parent(parent, path=module_path)

    return make
