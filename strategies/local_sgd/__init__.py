"""The local-SGD family: islands (the dp_replicate axis) train apart and synchronise now and then.

One technique per file: `DiLoCo` (and Streaming DiLoCo, its ``num_fragments``) in diloco.py,
`DESLOC` (and Local Adam, its equal periods) in desloc.py, `Hierarchical` (DASO) in
hierarchical.py, `IST` (Independent Subnet Training) in ist.py, and what they share (`LocalSGD`,
byte accounting) in base.py. Select one with
``strategy=diloco`` (or streaming_diloco, desloc, local_adam, hierarchical, daso, ist) or
``strategy.local_sgd._target_=strategies.local_sgd.DiLoCo``.
"""

from strategies.local_sgd.base import LocalSGD, allreduce_bytes_sent, average_
from strategies.local_sgd.desloc import DESLOC
from strategies.local_sgd.diloco import DiLoCo
from strategies.local_sgd.hierarchical import Hierarchical
from strategies.local_sgd.ist import IST

__all__ = ["DESLOC", "IST", "DiLoCo", "Hierarchical", "LocalSGD", "allreduce_bytes_sent", "average_"]
