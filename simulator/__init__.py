"""A simulated fleet: N virtual nodes in one asyncio process, talking to a real control plane.

The Python API (what a demo command drives)::

    from simulator import FleetSimulator, PoolSpec, FleetThread

    sim = FleetSimulator("http://127.0.0.1:8000", pools=[PoolSpec("general", "npb_…")], seed=1)
    with FleetThread(sim) as fleet:        # an event loop in a background thread
        fleet.enroll(300)                  # tqdm progress bar; returns the enrolled names
        fleet.start()                      # heartbeats in the background
        fleet.partition("sim-1-0007")      # faults on named nodes, any time
        fleet.restart("sim-1-0008")
        print(fleet.stats())
    # leaving the block stops the heartbeats and the loop
"""

from .fleet import FleetSimulator, FleetThread
from .node import VirtualNode
from .shapes import NodeSpec, PoolSpec

__all__ = ["FleetSimulator", "FleetThread", "NodeSpec", "PoolSpec", "VirtualNode"]
