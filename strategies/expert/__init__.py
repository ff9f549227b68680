"""Expert parallelism for mixtures of experts: the plugin, token dispatch and the least-loaded placement."""
