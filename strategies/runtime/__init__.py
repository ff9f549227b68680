"""Process runtime: launchers, the heartbeat watchdog, gloo settings, the collective device, the host allocator, the compute timer."""
