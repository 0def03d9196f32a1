"""Kubernetes label selectors over a node's labels.

The grammar is all of Kubernetes' (k8s.io/apimachinery/pkg/labels ``Parse``), ported lexer and
parser alike so that the same strings parse and fail: comma-separated requirements, all of which
must hold::

    zone=a            equality (also ``zone==a``); ``zone=`` is the empty value
    zone!=a           inequality: the label is absent or has another value
    zone in (a,b)     set membership (``zone in ()`` is the set of the empty value)
    zone notin (a)    absent, or not one of the values
    gpu               the label exists
    !gpu              the label does not exist
    gen>3, gen<7      the label exists and, read as a decimal integer, is greater (less) than

Keys are Kubernetes label keys (``topology.kubernetes.io/zone``); values are label values
(at most 63 characters of ``[A-Za-z0-9._-]``, alphanumeric at both ends, or empty). Inside a set,
``in`` and ``notin`` are values; empty elements (``(a,,b)``, ``(,a)``, ``(a,)``) are the empty
value, as Kubernetes reads them. tests/fleet/test_label_selectors.py runs Kubernetes' own parser
strings (``TestSelectorParse`` and ``TestSetSelectorParser``: 51 strings) against this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .capability import label_key_ok
from .labelview import label_view

_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
_INT64 = re.compile(r"^[+-]?[0-9]+$")
MAX_SELECTOR = 1000
_WHITESPACE = " \t\r\n"
_SPECIAL = "=!(),><"
# Kubernetes' string2token: the symbols (longest match wins) and the two keywords.
_SYMBOLS = {")": ")", ",": ",", "!": "!", "==": "==", "=": "=", ">": ">", "<": "<", "!=": "!=", "(": "("}
_KEYWORDS = {"in": "in", "notin": "notin"}
IDENT, END = "identifier", "end of string"
OPERATORS = ("=", "!=", "in", "notin", "exists", "!exists", ">", "<")


class SelectorError(ValueError):
    """A selector that is not valid Kubernetes label-selector syntax; the message says where."""


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # one of OPERATORS ("==" is read as "=")
    values: tuple[str, ...] = ()

    def matches(self, labels: dict[str, str]) -> bool:
        """Kubernetes' ``Requirement.Matches`` on one label set (absent keys as Kubernetes treats them)."""
        present = self.key in labels
        value = labels.get(self.key)
        if self.operator in ("=", "in"):
            return present and value in self.values
        if self.operator in ("!=", "notin"):
            return not present or value not in self.values
        if self.operator == "exists":
            return present
        if self.operator == "!exists":
            return not present
        # ">" / "<": present, and both read as 64-bit decimal integers
        number = _int64(value) if present else None
        if number is None:
            return False
        bound = int(self.values[0])
        return number > bound if self.operator == ">" else number < bound


def _int64(value) -> int | None:
    if not isinstance(value, str) or not _INT64.fullmatch(value):
        return None
    number = int(value)
    return number if -(2**63) <= number < 2**63 else None


def _lex(selector: str) -> list[tuple[str, str]]:
    """Kubernetes' ``Lexer``: (token, literal) pairs ending with END; an ERROR token for a run of
    special characters that is no symbol."""
    tokens, pos, size = [], 0, len(selector)
    while True:
        while pos < size and selector[pos] in _WHITESPACE:
            pos += 1
        if pos >= size:
            tokens.append((END, ""))
            return tokens
        if selector[pos] in _SPECIAL:
            buffer, last = "", None
            while pos < size and selector[pos] in _SPECIAL:
                buffer += selector[pos]
                if buffer in _SYMBOLS:
                    last = (_SYMBOLS[buffer], buffer)
                    pos += 1
                elif last is not None:
                    break
                else:
                    pos += 1
            if last is None:
                raise SelectorError(f"unexpected {buffer!r}")
            tokens.append(last)
        else:
            start = pos
            while pos < size and selector[pos] not in _SPECIAL and selector[pos] not in _WHITESPACE:
                pos += 1
            word = selector[start:pos]
            tokens.append((_KEYWORDS.get(word, IDENT), word))


class _Parser:
    """Kubernetes' ``Parser``: in the values context, ``in`` and ``notin`` are identifiers."""

    def __init__(self, selector: str):
        self.items, self.position = _lex(selector), 0

    def _read(self, advance: bool, values: bool = True) -> tuple[str, str]:
        token, literal = self.items[min(self.position, len(self.items) - 1)]
        if advance:
            self.position += 1
        if values and token in _KEYWORDS:
            token = IDENT
        return token, literal

    def lookahead(self) -> tuple[str, str]:
        return self._read(False)

    def consume(self, values: bool = True) -> tuple[str, str]:
        return self._read(True, values)

    def parse(self) -> list[Requirement]:
        requirements = []
        while True:
            token, literal = self.lookahead()
            if token == END:
                return requirements
            if token not in (IDENT, "!"):
                raise SelectorError(f"found {literal!r}, expected: !, identifier, or end of string")
            requirements.append(self.requirement())
            token, literal = self.consume()
            if token == END:
                return requirements
            if token != ",":
                raise SelectorError(f"found {literal!r}, expected: ',' or end of string")
            after, literal = self.lookahead()
            if after not in (IDENT, "!"):
                raise SelectorError(f"found {literal!r}, expected: identifier after ','")

    def requirement(self) -> Requirement:
        token, key = self.consume()
        negated = token == "!"
        if negated:
            token, key = self.consume()
        if token != IDENT:
            raise SelectorError(f"found {key!r}, expected: identifier")
        if not label_key_ok(key):
            raise SelectorError(f"{key!r} is not a label key")
        if self.lookahead()[0] in (END, ","):
            return Requirement(key, "!exists" if negated else "exists")
        if negated:  # "!x=a": '!' only before a bare key (Kubernetes: the operator is DoesNotExist)
            raise SelectorError(f"'!{key}': '!' goes only before a bare key")
        token, literal = self.consume(values=False)
        if token in ("in", "notin"):
            values = self.set_values()
        elif token in ("=", "==", "!=", ">", "<"):
            values = self.exact_value()
        else:
            raise SelectorError(f"found {literal!r}, expected: in, notin, =, ==, !=, >, <")
        operator = {"==": "="}.get(token, token)
        for value in values:
            if not _VALUE.fullmatch(value):
                raise SelectorError(f"{value!r} is not a label value")
        if operator in (">", "<") and _int64(values[0]) is None:
            raise SelectorError(f"{key}{operator}{values[0]}: for '>' and '<' the value must be an integer")
        return Requirement(key, operator, values)

    def exact_value(self) -> tuple[str, ...]:
        if self.lookahead()[0] in (END, ","):
            return ("",)
        token, literal = self.consume()
        if token != IDENT:
            raise SelectorError(f"found {literal!r}, expected: identifier")
        return (literal,)

    def set_values(self) -> tuple[str, ...]:
        token, literal = self.consume()
        if token != "(":
            raise SelectorError(f"found {literal!r}, expected: '('")
        token, literal = self.lookahead()
        if token == ")":
            self.consume()
            return ("",)
        if token not in (IDENT, ","):
            raise SelectorError(f"found {literal!r}, expected: ',', ')' or identifier")
        values: list[str] = []
        while True:
            token, literal = self.consume()
            if token == IDENT:
                values.append(literal)
                after, literal = self.lookahead()
                if after == ")":
                    break
                if after != ",":
                    raise SelectorError(f"found {literal!r}, expected: ',' or ')'")
            elif token == ",":
                after = self.lookahead()[0]
                if not values or after in (")", ","):
                    values.append("")  # "(,", ",)" and ",,": the empty value
                if after == ")":
                    break
            else:
                raise SelectorError(f"found {literal!r}, expected: ',' or identifier")
        self.consume()  # ")"
        return tuple(dict.fromkeys(values))


def parse_selector(selector: str) -> list[Requirement]:
    """Parse ``selector`` into requirements (all must hold); ``""`` selects everything.

    Raises:
        SelectorError: the selector is malformed as Kubernetes' parser finds it (an empty
            requirement, a bad key or value, unbalanced parentheses, ``x<a``…), or is longer than
            1000 characters.
    """
    if len(selector) > MAX_SELECTOR:
        raise SelectorError(f"longer than {MAX_SELECTOR} characters")
    return _Parser(selector).parse()


def matches(requirements: Iterable[Requirement], labels: dict[str, str]) -> bool:
    """Whether ``labels`` satisfy every requirement."""
    return all(req.matches(labels) for req in requirements)


# Where a selector looks on a node: the label set placement matches on (the node list's ``label``
# filter, bulk actions), or one stored document alone (``node_label``: what the node declares).
PLACEMENT, NODE_DECLARED = "placement", "node_labels"


def _placement_view(row: dict) -> dict[str, str]:
    return label_view(
        pk=row["pk"],
        hostname=row["hostname"],
        pool_name=row["pool__name"] or "",
        pool_labels=row["pool__labels"],
        trust_node_labels=bool(row["pool__trust_node_labels"]),
        node_labels=row["node_labels"],
        labels=row["labels"],
        verified=row["verified"],
    )


def _declared_view(row: dict) -> dict[str, str]:
    return {k: str(v) for k, v in (row["node_labels"] or {}).items()}


VIEWS: dict[str, tuple[tuple[str, ...], Callable[[dict], dict[str, str]]]] = {
    PLACEMENT: (
        ("pk", "hostname", "pool__name", "pool__labels", "pool__trust_node_labels", "node_labels", "labels",
         "verified"),
        _placement_view,
    ),
    NODE_DECLARED: (("pk", "node_labels"), _declared_view),
}  # fmt: skip


def filter_nodes(queryset, selectors: Iterable[str], *, view: str = PLACEMENT):
    """``queryset`` (of nodes) narrowed to those whose label set ``view`` matches every selector.

    ``PLACEMENT`` is :func:`fleet.labelview.label_view`, the set placement matches on: platform
    labels, pool labels, identity and verified features, and node-declared labels only where the
    pool trusts them. The view is built per node in Python from one query of the label columns,
    then the queryset keeps the matching primary keys. Cost, measured on a busy 2-core machine:
    the Python part took 366 ms for 10,000 nodes (about 37 ms per 1,000), plus the query; nothing
    is narrowed in SQL first (yet).

    Raises:
        SelectorError: see :func:`parse_selector`; nothing is filtered then.
    """
    requirements = [req for selector in selectors for req in parse_selector(selector)]
    if not requirements:
        return queryset
    columns, build = VIEWS[view]
    rows = queryset.order_by().values(*columns)
    keep = [row["pk"] for row in rows if matches(requirements, build(row))]
    return queryset.filter(pk__in=keep)
