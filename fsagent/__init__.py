"""fsagent: the in-sandbox FUSE daemon that presents one work folder per mount.

Its modules sit in packages by concern, each importing only the layers below
it (``.importlinter``: cli, localapi, commands, the fuse, dirmode and repos
packages, checkpoint, state and control, bridge and scan, the shared leaves).
The map of every module is ARCHITECTURE.md's "Code map".

Loggers keep the names they had before the packages (``fsagent.ship``,
``fsagent.fs``, ``fsagent.http``, ...): log lines name their logger, so moving
a module changes no log line.
"""

SPIN_US = 100
"""Default ``--spin-us``: the longest the daemon keeps polling after a request
(see :class:`fsagent.fuse.glue.Spinner`)."""
