import pytest


@pytest.fixture(autouse=True)
def warm_cache(tmp_path_factory, monkeypatch):
    """Every lab test caches its warm starts in a folder of its own, never in the user's cache
    (subprocesses inherit the variable)."""
    path = tmp_path_factory.mktemp("xdg-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(path))
    return path / "pgloss" / "warm"
