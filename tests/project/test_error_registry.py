"""One error registry (nodepool.api.errors): every problem code declared once, the docs table
generated from it, no call site spelling a code, merged families answered with deprecated_code."""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import pytest
from django.core.management import call_command

from nodepool.api import errors
from nodepool.api.problems import Conflict, NotFound, Problem, problem_body

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("nodepool", "fleet", "leases", "maintenance", "operations", "marketplace")
# Constructors and helpers that take a problem code, with the position of the code argument.
PROBLEM_CALLS = {
    "Problem": 1, "Conflict": 1, "Gone": 1, "PreconditionFailed": 1, "PreconditionRequired": 1,
    "PayloadTooLarge": 1, "TooManyRequests": 1, "ServiceUnavailable": 1, "Unprocessable": 1,
    "Forbidden": 1, "NotFound": 1, "problem_response": 1, "problem_body": 1,
}  # fmt: skip
# Helpers whose name says they build a refusal (leases.spec.bad, operations' _bad, _problem…), and
# exceptions later turned into problems (DeviceRequestError, SignatureError…).
HELPER = re.compile(r"((^|_)(bad|problem|refused?)|Error)$")


def _product_modules():
    for package in PRODUCT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" not in path.parts and path.name != "errors.py":
                yield path


def _spelled_codes(path: Path) -> list[str]:
    """Places in ``path`` where a problem code is a string literal instead of a declared constant."""
    declared = {str(code) for code in errors.registered()}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        literals = []
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            index = PROBLEM_CALLS.get(name)
            if index is not None and len(node.args) > index:
                literals.append(node.args[index])
            # code=… elsewhere may be another vocabulary (placement reasons): only declared names count.
            code_kw = [kw.value for kw in node.keywords if kw.arg == "code"]
            literals += [
                v for v in code_kw if index is not None or (isinstance(v, ast.Constant) and v.value in declared)
            ]
            if HELPER.search(name):
                literals += [arg for arg in node.args if isinstance(arg, ast.Constant) and arg.value in declared]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            defaults = [d for a, d in zip(args.args[::-1], args.defaults[::-1], strict=False) if a.arg == "code"]
            defaults += [d for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if a.arg == "code" and d]
            # A field-level default (``code="invalid"`` of an ``errors`` item) is not a problem code.
            literals += [d for d in defaults if isinstance(d, ast.Constant) and d.value in declared]
        for literal in literals:
            if isinstance(literal, ast.Constant) and isinstance(literal.value, str):
                found.append(f"{path.relative_to(ROOT)}:{literal.lineno}: {literal.value!r}")
    return found


def test_no_call_site_spells_a_problem_code():
    """A code is raised by reference to its declaration (``NotFound("…", LEASE_NOT_FOUND)``), so an
    undeclared one fails at import, and renaming one is a change in one place."""
    spelled = [place for path in _product_modules() for place in _spelled_codes(path)]
    assert not spelled, "declare these in the app's errors.py and raise the constant:\n" + "\n".join(spelled)


def test_the_docs_table_is_generated_from_the_registry():
    text = (ROOT / "docs" / "api-contract.md").read_text()
    start, end = text.index(errors.TABLE_START), text.index(errors.TABLE_END) + len(errors.TABLE_END)
    assert text[start:end] == errors.markdown_table(), "run: python manage.py error_codes --write"
    call_command("error_codes", "--check")


def test_every_code_is_declared_once_with_an_error_status_and_a_docs_page():
    codes = errors.registered()
    current = [str(code) for code in codes if code.replaced_by is None]
    assert len(current) == len(set(current))
    for code in codes:
        assert 400 <= code.status <= 599 and code.title and code.app in PRODUCT, code
        page = code.doc.split("#")[0]
        assert (ROOT / page).is_file(), f"{code}: {code.doc} is not a docs page"


def test_each_app_declares_its_own_codes():
    by_app = {code.app for code in errors.registered()}
    assert by_app == set(PRODUCT)
    assert errors.lookup("lease_not_found").app == "leases"
    assert errors.lookup("node_not_found").app == "fleet"
    assert errors.lookup("validation_error").app == "nodepool"


def test_a_code_is_a_string_that_survives_pickling():
    from leases.errors import LEASE_NOT_FOUND

    assert LEASE_NOT_FOUND == "lease_not_found" and LEASE_NOT_FOUND.status == 404
    assert pickle.loads(pickle.dumps(LEASE_NOT_FOUND)) is LEASE_NOT_FOUND


def test_a_problem_takes_its_status_and_title_from_the_declaration():
    from fleet.errors import CONCURRENT_RENEWAL

    problem = Problem("The node changed during this renewal.", CONCURRENT_RENEWAL)
    assert problem.status_code == 409
    body = problem_body(409, CONCURRENT_RENEWAL, "x")
    assert (body["code"], body["title"], body["type"]) == (
        "concurrent_renewal",
        "Concurrent renewal",
        "https://nodepool.dev/problems/concurrent-renewal",
    )
    assert "deprecated_code" not in body


def test_an_undeclared_code_or_a_wrong_status_fails_under_strict():
    assert errors.STRICT  # tests/conftest.py
    with pytest.raises(AssertionError, match="not declared"):
        Problem("x", "no_such_code_anywhere")
    with pytest.raises(AssertionError, match="declared 404 but answered 409"):
        Conflict("x", errors.NOT_FOUND)
    NotFound("x")  # the class's default code is declared with its status


def test_an_undeclared_code_is_logged_not_raised_in_production(monkeypatch, caplog):
    monkeypatch.setattr(errors, "STRICT", False)
    body = problem_body(400, "no_such_code_anywhere", "x")
    assert body["code"] == "no_such_code_anywhere"
    assert "not declared" in caplog.text


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("invalid_request", "validation_error"),
        ("invalid_field", "validation_error"),
        ("invalid_upgrade", "validation_error"),
        ("invalid_body", "malformed_body"),
        ("permission_denied", "forbidden"),
    ],
)
def test_a_merged_code_answers_the_new_code_and_names_the_old_one(old, new):
    deprecated = errors.lookup(old)
    assert deprecated.replaced_by == new
    body = problem_body(deprecated.status, deprecated, "x")
    assert (body["code"], body["deprecated_code"], body["type"]) == (
        new,
        old,
        "https://nodepool.dev/problems/" + new.replace("_", "-"),
    )


def test_invalid_deadline_stays_the_400_and_its_422_is_deadline_out_of_range():
    from operations.errors import INVALID_DEADLINE, INVALID_DEADLINE_RANGE

    assert errors.lookup("invalid_deadline") is INVALID_DEADLINE and INVALID_DEADLINE.status == 400
    body = problem_body(422, INVALID_DEADLINE_RANGE, "x")
    assert (body["code"], body["deprecated_code"]) == ("deadline_out_of_range", "invalid_deadline")


def test_declaring_a_code_twice_from_another_app_is_refused():
    with pytest.raises(ValueError, match="declared twice"):
        errors.declare("lease_not_found", 409, doc="docs/leases.md")
    with pytest.raises(ValueError, match="snake_case"):
        errors.declare("Lease-Gone", 410, doc="docs/leases.md")
