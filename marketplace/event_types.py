"""The marketplace's event types (fleet.event_types explains the registry): stored values never
change. Statements and appeals are private: they carry the owner's money and words, so only the
node's owner and operators read them (fleet.api.events). ``statement`` events of no node (a
statement's, a payout's, a payout hold's, a line appeal's) carry ``data.owner``, the owner's user
id: that owner reads them (``owner_key``)."""

from fleet.event_types import declare

USAGE = declare("usage", "usage evidence or reconciliation")
STATEMENT = declare("statement", "owner statement", private=True, owner_key="owner")
APPEAL = declare("appeal", "quarantine appeal", private=True)
