"""Leases' raw SQL, in one place: the named statements of the grant and of placement, each saying
why it is SQL.

Everywhere else leases uses the ORM. A statement is here when the ORM cannot say it (an upsert
``… ON CONFLICT … RETURNING``, a ``WITH … AS MATERIALIZED`` table ahead of a queryset, a planner
setting for one statement, a row lock ``FOR SHARE`` without loading a model), or when building
the queryset costs more than running the statement on a path every grant takes (the grant's three
statements, the candidate page, the device claim: compiling them through the ORM cost more than
running them), or when a rule decided in SQL saves loading thousands of nodes' rows into Python
(the device rules of placement and the 409).

Rules kept by every statement: identifiers are the models' (from their ``_meta``, never from
input; the device statements, moved here as they were, still spell ``fleet_device`` and
``leases_leasedevice`` and their columns out), every value is a bound parameter. The
PostgreSQL/SQLite differences are :mod:`.vendor`'s; the statements ask for them instead of testing
the vendor themselves.

- :mod:`.vendor`: the PostgreSQL/SQLite differences, and quoted table and column names;
- :mod:`.grant`: the grant's statements (the fencing token, the node's hold, the capacity UPDATE);
- :mod:`.candidates`: the candidate page of placement;
- :mod:`.census`: the 409 census (hostnames, the devices' fingerprint, planner settings, ``WITH``);
- :mod:`.devices`: the grant's device claim, and the device rules for placement and the 409.

Callers import the module they need (``from leases.sql import grant as grant_sql``); this package
re-exports nothing.
"""
