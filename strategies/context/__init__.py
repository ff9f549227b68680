"""Context parallelism: the plugin (ring, Ulysses, hybrid), the cp layout and row placement, ring attention, document shards."""
