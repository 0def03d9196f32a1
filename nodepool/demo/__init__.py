"""``manage.py demo``: the whole control plane with this machine and a simulated fleet.

Modules: :mod:`.processes` (web, worker, beat and the agent as subprocesses), :mod:`.client`
(the operator's HTTP client and polling), :mod:`.setup` (operator, pools, bootstrap tokens),
:mod:`.story` (the checked steps) and :mod:`.report` (the summary).
"""
