"""The control socket: its protocol and client (``protocol``, cheap to import)
and the daemon's side (``server``)."""
