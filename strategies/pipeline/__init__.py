"""Pipeline parallelism: the plugin (torch.distributed.pipelining schedules) and the stage layout."""
