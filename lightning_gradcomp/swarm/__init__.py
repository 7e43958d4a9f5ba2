"""SwarmSGD: decentralized training with local steps and quantized pairwise gossip."""

from lightning_gradcomp.swarm.asynchronous import AsyncGossip, StoreMatchmaker
from lightning_gradcomp.swarm.exchange import LatticeCodec, PairwiseGossip, SwarmStats
from lightning_gradcomp.swarm.pairing import TOPOLOGIES, matching, topology_edges
from lightning_gradcomp.swarm.strategy import SwarmStrategy

__all__ = [
    "TOPOLOGIES",
    "AsyncGossip",
    "LatticeCodec",
    "StoreMatchmaker",
    "PairwiseGossip",
    "SwarmStats",
    "SwarmStrategy",
    "matching",
    "topology_edges",
]
