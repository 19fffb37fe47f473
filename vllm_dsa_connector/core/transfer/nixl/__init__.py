"""The NIXL wrapper: agents, peers, reconnects, transfers."""
