"""What the trainers' conformance tests share, imported by each (a conftest.py here would shadow tests/conftest.py,
which the other tests import by name). A test module names its trainer module `conformance`
(`pgloss.conformance.<trainer>`); its tests are skipped unless the trainer's loss can run here (checked when
they run, not at collection), and its cases are computed once per module. The fixtures are named `installed` and
`cases` in the tests; their functions carry other names, so that a test's argument does not shadow the import."""

import pytest


@pytest.fixture(scope="module", autouse=True, name="installed")
def trainer_installed(request):
    module = getattr(request.module, "conformance", None)
    why = None if module is None else module.available()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module", name="cases")
def trainer_cases(request, installed):
    return list(request.module.conformance.cases())
