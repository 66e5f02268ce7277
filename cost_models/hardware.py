"""Hardware profiles and ClusterSpec (being built: issue 3)."""
from dataclasses import dataclass


@dataclass
class ClusterSpec:  # placeholder, replaced by issue 3
    nodes: int = 1
    gpus_per_node: int = 8
    device: str = "h100-sxm"
