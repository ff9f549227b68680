"""Checkpoints: the distributed checkpoint (DCP) writer and reader, its manifest, safe loading and write failures."""
