"""django-fsm-2 helpers shared by the apps' state machines.

django-fsm-2's ``FSMModelMixin.refresh_from_db`` (which ``ConcurrentTransitionMixin`` inherits)
lifts the ``protected`` flag on the *field object*, shared by every instance in the process, for the
length of the reload, and sets it back afterwards. Two threads refreshing instances of one model at
once (a deferred field loaded on first access is a refresh too) interleave: the one that finishes
first re-protects the field while the other is still assigning it, and that one fails with
``AttributeError: Direct lifecycle modification is not allowed``. Seen in the threaded race tests and
the live-server end-to-end tests (marketplace availability loading a deferred node field during a
status report). Gunicorn's sync workers are single-threaded, but Celery thread pools and gthread
workers are not.
"""

from __future__ import annotations

import threading

from django_fsm import FSMFieldMixin, FSMModelMixin

# One lock for every protected-FSM model: the flag lives on each model's field, but refreshes are
# short (one SELECT by primary key, which takes no row lock), so one lock costs nothing measurable.
_REFRESH = threading.RLock()


class SerializedFSMRefresh(FSMModelMixin):
    """Put first in the bases of every model with a protected ``FSMField`` (a test checks): gives it
    django-fsm's ``refresh_from_db`` (without which a refresh of a loaded protected field always
    fails) and serializes that method's flag toggling across threads. Same signature and errors as
    Django's ``Model.refresh_from_db``."""

    def refresh_from_db(self, *args, **kwargs):
        with _REFRESH:
            super().refresh_from_db(*args, **kwargs)


# --- the declared graph as data: set-based statements and the generated docs read it -----------


def _meta(model, name: str):
    """The django-fsm-2 ``FSMMeta`` of transition ``model.<name>`` (AttributeError if ``name`` is
    not a declared transition)."""
    return getattr(model, name)._django_fsm


def _state_values(model, field_name: str) -> list[str]:
    return [value for value, _label in model._meta.get_field(field_name).choices]


def state_field(model, name: str) -> str:
    """The name of the ``FSMField`` that transition ``model.<name>`` moves."""
    field = _meta(model, name).field
    return field if isinstance(field, str) else field.name


def sources(model, name: str) -> tuple[str, ...]:
    """The states transition ``model.<name>`` may start from, as stored values in declaration
    order: what a set-based statement's ``WHERE state IN (…)`` must list, so the statement and the
    declared graph cannot drift apart (issue 28, step 6). django-fsm-2's wildcards are expanded
    over the field's choices: ``"*"`` is every state, ``"+"`` every state but the target."""
    meta = _meta(model, name)
    values = _state_values(model, state_field(model, name))
    found: list[str] = []
    for source, transition in meta.transitions.items():
        if source == "*":
            found.extend(values)
        elif source == "+":
            found.extend(v for v in values if v != transition.target)
        else:
            found.append(source)
    return tuple(dict.fromkeys(found))


def target(model, name: str) -> str:
    """The one state transition ``model.<name>`` moves to (ValueError when its sources declare
    different targets, or the target is computed at run time with ``RETURN_VALUE``)."""
    targets = {t.target for t in _meta(model, name).transitions.values()}
    if len(targets) != 1 or not isinstance(next(iter(targets)), str):
        raise ValueError(f"{model.__name__}.{name} has no single fixed target: {targets}")
    return targets.pop()


def move(queryset, name: str, **changes) -> int:
    """Set-based transition: ``UPDATE … SET state = <target>, **changes WHERE <queryset> AND state
    IN (<sources>)``, both read from the declared transition ``<model>.<name>`` — the sweep's or
    the claim's statement (STYLE.md habit 6) with the graph as its single source. Returns the
    number of rows moved (0 when another writer moved them first). Conditions and side effects
    on the model are not run: the caller's filter is the condition."""
    model = queryset.model
    field = state_field(model, name)
    return queryset.filter(**{f"{field}__in": sources(model, name)}).update(**{field: target(model, name)}, **changes)


def transitions(model) -> list[tuple[str, str, str, str]]:
    """Every declared transition of ``model``: ``(field, source, target, method name)`` rows, in
    declaration order, wildcards kept as written (``*``, ``+``); a computed target
    (``RETURN_VALUE``) is listed once per state it may return."""
    rows: list[tuple[str, str, str, str]] = []
    fsm_fields = [f.name for f in model._meta.get_fields() if isinstance(f, FSMFieldMixin)]
    seen: set[int] = set()
    for klass in model.__mro__:
        for attr, value in vars(klass).items():
            meta = getattr(value, "_django_fsm", None)
            if meta is None or id(meta) in seen:
                continue
            seen.add(id(meta))
            field = meta.field if isinstance(meta.field, str) else meta.field.name
            if field not in fsm_fields:
                continue
            for source, transition in meta.transitions.items():
                returned = getattr(transition.target, "allowed_states", None)
                for goal in returned or [transition.target]:
                    rows.append((field, str(source), str(goal), attr))
    return rows


def mermaid(model) -> str:
    """A Mermaid ``stateDiagram-v2`` of ``model``'s declared transitions, one per FSM field."""
    out: list[str] = []
    rows = transitions(model)
    for field in dict.fromkeys(r[0] for r in rows):
        out.append(f"#### `{model._meta.label}.{field}`\n")
        out.append("```mermaid\nstateDiagram-v2")
        default = model._meta.get_field(field).default
        if isinstance(default, str):
            out.append(f"    [*] --> {default}")
        for _f, source, goal, name in (r for r in rows if r[0] == field):
            shown = {"*": "any", "+": "any_other"}.get(source, source)
            out.append(f"    {shown} --> {goal}: {name}")
        out.append("```\n")
    return "\n".join(out)
