"""pgloss.conformance.sources: a trainer's definitions cut out of its file and run, without importing it."""

import textwrap

import pytest

from pgloss.conformance.sources import load, locate

TRAINER_FILE = textwrap.dedent('''
    import some_training_stack  # never imported: only the named definitions run

    SCALE = 3.0

    def helper(x: "Tensor") -> "Tensor":
        return SCALE * x

    class Trainer(SomeBase):
        @some_decorator
        def loss(self, x: GRPOBatch) -> Dict[str, Any]:
            text = """a docstring
    that leaves the method's indentation"""
            return helper(x) + self.offset + len(text.splitlines())
''')


def test_functions_assignments_and_methods(tmp_path):
    path = tmp_path / "trainer.py"
    path.write_text(TRAINER_FILE)
    namespace = load(path, ("SCALE", "helper"), {})
    assert namespace["helper"](2.0) == 6.0
    load(path, ("loss",), namespace, within="Trainer")  # decorator dropped, annotations never evaluated
    stub = type("Stub", (), {"offset": 1.0})()
    assert namespace["loss"](stub, 2.0) == 6.0 + 1.0 + 2


def test_missing_definitions_are_named(tmp_path):
    path = tmp_path / "trainer.py"
    path.write_text(TRAINER_FILE)
    with pytest.raises(LookupError, match=r"defines none of \['absent'\]"):
        load(path, ("helper", "absent"), {})
    with pytest.raises(LookupError, match="defines no class Other"):
        load(path, ("loss",), {}, within="Other")


def test_locate_prefers_the_variable(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "loss.py").write_text("")
    monkeypatch.setenv("PGLOSS_TEST_SRC", str(tmp_path))
    assert locate("no-such-dist", "pkg/loss.py", "PGLOSS_TEST_SRC", "pip install x") == tmp_path / "pkg" / "loss.py"
    monkeypatch.delenv("PGLOSS_TEST_SRC")
    assert locate("no-such-dist", "pkg/loss.py", "PGLOSS_TEST_SRC", "pip install x") == (
        "no-such-dist is not installed (pip install x; or set PGLOSS_TEST_SRC to the root of its source)"
    )
