"""The scan engine for trees on the sandbox's own disk (``engine``) and the
witness of ``git ls-files`` (``listing``)."""
