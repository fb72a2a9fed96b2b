"""No import cycle among captionkit's modules, deferred (function-level) imports included,
read from the source by benchmarks/import_graph.py; and that the checker does see cycles,
deferred imports and relative imports on a package made here."""

from helpers import import_graph_module

graph = import_graph_module()


def test_captionkit_has_no_import_cycle():
    edges = graph.import_graph()
    assert len(edges) > 40 and "captionkit.models.sat" in edges["captionkit.models"]
    assert graph.cycles(edges) == []


def test_the_checker_finds_a_cycle_through_a_deferred_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub.c import g\n    return g\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("import os\n\ndef g():\n    from ..a import x\n")
    edges = graph.import_graph(pkg)
    assert edges["pkg.a"] == {"pkg.b"} and edges["pkg.b"] == {"pkg.sub.c"} and edges["pkg.sub.c"] == {"pkg.a"}
    assert graph.cycles(edges) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    (pkg / "sub" / "c.py").write_text("def g():\n    return 1\n")
    assert graph.cycles(graph.import_graph(pkg)) == []


def test_shared_code_never_names_or_probes_a_family():
    """The trainer, self-critical training, the captioner, the exporters and decoding use the
    declared contract only: no family name as a string, no hasattr/getattr on a model or its
    config, no inspect."""
    import ast

    from captionkit.models import list_models
    root = graph.DEFAULT_ROOT
    for name in ("training/run.py", "training/stages.py", "training/trainer.py", "training/scst.py",
                 "inference/captioner.py", "export/exporters.py", "inference/decoding.py"):
        tree = ast.parse((root / name).read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not strings & {*list_models(), "hard", "decode_context"}, name  # (hard attention: a sat option)
        probes = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("hasattr", "getattr") and n.args
                  and any(w in ast.unparse(n.args[0]) for w in ("model", "decoder"))]
        assert not probes, (name, probes)
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert "inspect" not in imported, name


def test_tests_take_shared_helpers_from_helpers_not_conftest():
    """conftest.py holds fixtures only; what tests share is imported from tests/helpers.py
    (importing conftest as a module loads it twice, with its own copies of the fixtures' state)."""
    from pathlib import Path

    root = Path(__file__).parent.parent
    offenders = [str(p.relative_to(root)) for folder in ("tests", "benchmarks") for p in (root / folder).rglob("*.py")
                 if "from conftest import" in p.read_text() and p.name != Path(__file__).name]
    assert offenders == []
