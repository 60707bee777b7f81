"""Checkpoints: the change set shipped (``ship``), on a thread of its own
(``thread``), and the run's lifecycle shared by both modes (``lifecycle``)."""
