"""Checkpoints: the distributed checkpoint (DCP) writer and reader, its background saves, the finiteness
check, its manifest, safe loading and write failures."""
