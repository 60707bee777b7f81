"""What the CLI commands run: ``fsagent mount`` (``daemon``), ``up``, ``launch``,
``doctor``, and the agent's env file (``envfile``) they write and read."""
