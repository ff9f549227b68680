"""Layout planner: predict per-rank memory and step time of every layout, rank them before launch.

``plait plan model=... data.seq_len=... cluster=...`` (trainer/cli.py) enumerates layouts
(`search`), predicts their memory (`memory`) and step time (`time`), drops those over the memory
cap and prints a ranked table with the Hydra overrides of the best (`report`). Cluster presets live
in conf/cluster/; `calibrate` measures the running machine; `measure` checks the memory model
against a real run. ``planner.check=true`` on a run fails a predicted out-of-memory before launch.
"""
