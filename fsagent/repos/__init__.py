"""The task's repository checkouts: ``fsagent repos`` (``checkouts``), one
checkout prepared (``prepare``), saved (``save``), and what a checkpoint of it
holds (``capture``)."""
