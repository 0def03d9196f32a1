"""Every benchmark has a --quick smoke mode, and CI's runner finds new benches by itself."""

import ast

from bench import quick


def test_the_runner_discovers_every_bench_script_and_only_those():
    found = {path.name for path in quick.discover()}
    assert {"heartbeats.py", "placement.py", "sweep.py"} <= found
    assert not found & quick.NOT_BENCHES


def test_every_bench_declares_a_quick_flag():
    for path in quick.discover():
        tree = ast.parse(path.read_text())
        flags = {
            arg.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
            for arg in node.args
            if isinstance(arg, ast.Constant)
        }
        assert "--quick" in flags, f"{path.name} has no --quick mode (CI runs every bench with it)"


def test_a_bench_must_end_with_one_json_object_line():
    assert quick.last_json_line('seeded 300 nodes\n{"bench": "x", "rps": 1.5}\n') == {"bench": "x", "rps": 1.5}
    for bad in ("", "done\n", "[1, 2]\n"):
        try:
            quick.last_json_line(bad)
        except ValueError:
            continue
        raise AssertionError(f"accepted {bad!r}")
