"""fsagent: the in-sandbox FUSE daemon that presents one work folder per mount.

Layers, top down (one module each):

``cli``      ``fsagent mount | up | status | changes | flush | bridge | launch | doctor``
``up``       all four mounts and the local endpoint under one home; the env file
``localbridge`` ``fsagent bridge``: sandbox code's API calls, forwarded with the run token
``launch``   ``fsagent launch``: CLI probes, install commands, then the agent's command
``doctor``   ``fsagent doctor``: the runtime contract, one line per check
``mount``    one collection's life: bind the state, hydrate, serve FUSE, stop cleanly
``fs``       pyfuse3 operations: copy-on-write over saved contents, POSIX semantics
``hydrate``  manifest into LMDB; contents fetched on first open and prefetched
``ship``     checkpoints: the journal's change set shipped to the controller
``store``    LMDB inodes, entries, baseline and journal; ``objects/`` and ``upper/``
``client``   the bridge to the controller (HTTP), or a local directory for tests
``errors``   fsagent's failures and their exit codes

The change set since the baseline, which checkpoints ship, comes from
:meth:`fsagent.store.Store.changes_since_baseline`; what a checkpoint saved is
folded back with :meth:`fsagent.store.Store.acknowledge`.
"""

SPIN_US = 100
"""Default ``--spin-us``: the longest the daemon keeps polling after a request
(see :class:`fsagent.fuseglue.Spinner`)."""
