"""Strategy keys that moved into their plugin's node: old key -> new key. `strategies.mesh` refuses
the old ones naming the new, and ``plait`` names the new one for a mistyped override without
importing the strategy (Lightning, seconds) first. Imports nothing."""

MOVED_KEYS = {"cp_mode": "context_parallel.mode", "pp_schedule": "pipeline.schedule"}
