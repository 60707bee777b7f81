"""``fsagent bridge``: the local API endpoint that sandbox code calls (``endpoint``)."""
